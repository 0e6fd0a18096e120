"""Every backend against the kernel layer's contract (``kernels/contract.py``): each
kernel it exposes has the reference's signature, and every kernel has a reference."""

from __future__ import annotations

import importlib

import pytest

from te_fuser.kernels import contract

BACKENDS = ["triton", "cuda"]


def test_every_kernel_has_a_reference():
    for kernel in contract.KERNELS:
        assert callable(contract.reference(kernel)), kernel


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_exposes_kernels_with_the_references_signatures(backend):
    module = importlib.import_module(f"te_fuser.kernels.{contract.BACKEND_MODULES[backend]}")
    exposed = [k for k in contract.KERNELS if hasattr(module, k)]
    assert exposed, f"{backend} exposes no kernel"
    mismatches = [m for k in exposed if (m := contract.signature_mismatch(k, getattr(module, k))) is not None]
    assert not mismatches, f"{backend}: " + "; ".join(mismatches)


def test_the_dispatcher_serves_exactly_the_contracts_kernels():
    from te_fuser import backend

    assert backend.KERNELS is contract.KERNELS
    with pytest.raises(KeyError, match="no kernel named 'nope'"):
        contract.reference("nope")
