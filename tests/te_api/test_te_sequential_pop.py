"""Sequential.pop as TransformerEngine's (and nn.Sequential's): the module comes back,
the rest renumber and regroup, and the next call runs the new op list."""

import pytest
import torch

import te_fuser as te


def test_pop_returns_the_module_and_regroups():
    scale, identity = te.ops.ConstantScale(3.0), te.ops.Identity()
    model = te.ops.Sequential(te.ops.ConstantScale(2.0), torch.nn.Identity(), scale, identity)
    x = torch.ones(4, 8)
    assert torch.equal(model(x), 6 * x)
    assert model.pop() is identity and len(model) == 3
    assert model.pop(-1) is scale and len(model) == 2
    assert torch.equal(model(x), 2 * x)  # the popped scale no longer runs
    assert [type(m).__name__ for m in model] == ["ConstantScale", "Identity"]
    with pytest.raises(IndexError):
        model.pop(5)
