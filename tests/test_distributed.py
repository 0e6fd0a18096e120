"""Delayed scaling's amax reduction under torch.distributed, two CPU processes on
gloo, trained as users train: a te_fuser model in DDP, fused AdamW-style steps on
each rank's own half of the batch.

With ``reduce_amax=True`` (the default) and no group given, the amaxes are
all-reduced over the default process group, so every rank holds the same scaling
state (the same scales, histories and FP8 casts), in two collectives a step (the
forward's amaxes together, then the backward's); ``reduce_amax=False`` keeps each
rank's own; a group given to ``te.autocast`` is used instead; a process group
initialized after the model first ran counts from then on."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_testing import gathered, spawned

WORLD = 2
CASES = ("default", "no_reduction", "given_group", "initialized_late")


def _model():
    import te_fuser as te

    torch.manual_seed(0)
    return te.ops.Sequential(te.ops.LayerNorm(32), te.ops.Linear(32, 64), te.ops.GELU(), te.ops.Linear(64, 32))


def _scaling_state(model) -> torch.Tensor:
    """Every delayed-scaling quantizer's scale and amax history, flattened."""
    parts = []
    for op in model.modules():
        for q in getattr(op, "installed_quantizers", {}).values():
            parts += [t.reshape(-1).float() for t in q.state_tensors().values()]
    return torch.cat(parts)


def _train(rank: int, case: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(this rank's scaling state after the steps, the weights, the amax
    all-reduces of each step), for ``case``."""
    import te_fuser as te
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    recipe = te.recipe.DelayedScaling(amax_history_len=4, reduce_amax=case != "no_reduction")
    group = dist.new_group(list(range(WORLD))) if case == "given_group" else None
    data = torch.randn(4, WORLD, 16, 32, generator=torch.Generator().manual_seed(7))
    data[:, 1] *= 3.0  # rank 1's inputs (and so its gradients) are larger: unreduced amaxes differ
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    calls, all_reduce = [], dist.all_reduce

    def counted(*args, **kwargs):  # DDP's gradient buckets reduce in C++: these are te_fuser's
        calls[-1] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    try:
        for step in range(4):
            calls.append(0)
            with te.autocast(recipe=recipe, amax_reduction_group=group):
                loss = ddp(data[step, rank]).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        dist.all_reduce = all_reduce
    return _scaling_state(model), torch.cat([p.detach().reshape(-1) for p in model.parameters()]), calls


def _mismatch(rank: int) -> str:
    """Rank 1 trains under another margin than rank 0 (the same recipe class): the
    first reduction that compares them stops both, naming the ranks."""
    import te_fuser as te

    model = _model()
    recipe = te.recipe.DelayedScaling(amax_history_len=4, margin=rank)
    try:
        for _ in range(2):
            with te.autocast(recipe=recipe):
                model(torch.randn(16, 32)).square().mean().backward()
    except RuntimeError as err:
        return str(err)
    return "no error"


def _late(rank: int, store_file: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A model that ran once before the process group existed, then trains in it for
    more steps than its history holds (the entry of the unreduced first forward
    has left the window)."""
    import te_fuser as te

    model = _model()
    recipe = te.recipe.DelayedScaling(amax_history_len=4)
    with te.autocast(recipe=recipe):
        model(torch.randn(16, 32, generator=torch.Generator().manual_seed(rank)) * (1 + 2 * rank))
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD)
    data = torch.randn(5, WORLD, 16, 32, generator=torch.Generator().manual_seed(9))
    data[:, 1] *= 3.0
    for step in range(5):
        with te.autocast(recipe=recipe):
            model(data[step, rank]).square().mean().backward()
    return _scaling_state(model), torch.zeros(1)


def _worker(rank: int, folder: str, results) -> None:
    store = os.path.join(folder, "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        for case in CASES[:-1]:
            state, weights, calls = _train(rank, case)
            states, all_weights = gathered(state), gathered(weights)
            if rank == 0:
                results[case] = (torch.equal(*states), torch.equal(*all_weights))
                results[f"{case} collectives"] = calls
        message = _mismatch(rank)
        if rank == 0:
            results["mismatch"] = message
        dist.barrier()  # no rank tears the group down while another still talks through it
    finally:
        dist.destroy_process_group()
    state, _ = _late(rank, os.path.join(folder, "late_store"))
    try:
        states = gathered(state)
        if rank == 0:
            results["initialized_late"] = (torch.equal(*states), True)
        dist.barrier()
        results[f"done {rank}"] = True
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    return spawned(_worker, WORLD)


def test_the_default_group_reduces_the_amaxes(results):
    same_state, same_weights = results["default"]
    assert same_state, "reduce_amax=True without a group: the ranks' scaling states differ"
    assert same_weights, "DDP keeps the weights equal"


def test_the_amaxes_of_a_step_reduce_in_two_collectives(results):
    """After the first step (which seeds each quantizer from its own reduced amax),
    a step's amaxes go in one all-reduce for the forward's casts (at the end of the
    te.autocast region) and one for the backward's (at the end of the backward),
    however many tensors were cast; none without reduction."""
    first, *rest = results["default collectives"]
    assert rest == [2, 2, 2], results["default collectives"]
    assert first >= 2
    assert results["given_group collectives"][1:] == [2, 2, 2]
    assert results["no_reduction collectives"] == [0, 0, 0, 0]


def test_ranks_under_different_recipes_stop_with_an_error_naming_them(results):
    message = results["mismatch"]
    assert "ranks train under different recipes" in message and "ranks [0] and ranks [1]" in message, message
    assert "margin=0" in message, message  # this rank's own recipe key


def test_without_reduction_each_rank_keeps_its_own(results):
    same_state, same_weights = results["no_reduction"]
    assert not same_state, "reduce_amax=False: the ranks saw different amaxes and must keep them"
    assert same_weights


def test_a_given_group_is_used(results):
    assert results["given_group"][0]


def test_a_group_initialized_after_the_first_forward_counts(results):
    assert results["initialized_late"][0]


def test_one_process_reduces_nothing():
    """No process group: the same training runs without collectives."""
    import te_fuser as te

    model = _model()
    with te.autocast(recipe=te.recipe.DelayedScaling(amax_history_len=4)):
        model(torch.randn(8, 32)).sum().backward()
    assert _scaling_state(model).isfinite().all()


# -- FSDP2 per layer with a torch.distributed.checkpoint round trip ------------------


def _fsdp_model(mesh):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for module in model:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _dcp_round_trip(rank: int, folder: str) -> tuple[bool, bool, bool]:
    """Train an FSDP2 model (every op sharded, then the root) under its own delayed-
    scaling recipe (``te.apply_recipe``), save it with torch.distributed.checkpoint,
    load it into a fresh sharded model given the same recipe: (same scaling state,
    same weights, the next step's loss the same). A model with its own recipe has
    its ops' scaling-state keys from the start, which an in-place DCP load needs
    (it loads the keys the target has)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import te_fuser as te

    mesh = init_device_mesh("cpu", (WORLD,))
    recipe = te.recipe.DelayedScaling(amax_history_len=4)
    data = torch.randn(4, WORLD, 16, 32, generator=torch.Generator().manual_seed(3))
    model = te.apply_recipe(_fsdp_model(mesh), recipe, example_inputs=(data[0, rank],))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        model(data[step, rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(folder, "ckpt"))
    fresh = te.apply_recipe(_fsdp_model(mesh), recipe, example_inputs=(data[0, rank],))
    state = {"model": get_model_state_dict(fresh)}
    dcp.load(state, checkpoint_id=os.path.join(folder, "ckpt"))
    set_model_state_dict(fresh, state["model"])
    loss = model(data[3, rank]).square().mean()
    fresh_loss = fresh(data[3, rank]).square().mean()
    weights = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters()))
    return torch.equal(_scaling_state(model), _scaling_state(fresh)), weights, torch.equal(loss, fresh_loss)


def _dcp_worker(rank: int, folder: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'dcp_store')}", rank=rank,
                            world_size=WORLD)
    try:
        outcome = _dcp_round_trip(rank, folder)
        outcomes = [None] * WORLD
        dist.all_gather_object(outcomes, outcome)
        if rank == 0:
            results["dcp"] = outcomes
        dist.barrier()  # no rank tears the group down while another still talks through it
        results[f"done {rank}"] = True
    finally:
        dist.destroy_process_group()


def test_fsdp2_per_layer_checkpoints_through_dcp_with_the_scaling_state():
    outcomes = spawned(_dcp_worker, WORLD)["dcp"]
    for rank, (state, weights, loss) in enumerate(outcomes):
        assert weights, f"rank {rank}: the loaded weights differ"
        assert state, f"rank {rank}: the loaded scaling state differs"
        assert loss, f"rank {rank}: the next step's loss differs after the load"


# -- four processes ------------------------------------------------------------------

FOUR = 4


def _four_worker(rank: int, folder: str, results) -> None:
    """Four ranks in DDP under delayed scaling with the default reduction, every
    rank on its own data: their scaling states equal; then rank 3 alone trains
    under another margin, and every rank stops naming the two sets of ranks."""
    import te_fuser as te
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store4')}", rank=rank,
                            world_size=FOUR)
    try:
        model = _model()
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        recipe = te.recipe.DelayedScaling(amax_history_len=4)
        data = torch.randn(3, FOUR, 8, 32, generator=torch.Generator().manual_seed(5))
        data *= torch.arange(1, FOUR + 1).reshape(1, FOUR, 1, 1)  # every rank's amaxes differ
        for step in range(3):
            with te.autocast(recipe=recipe):
                ddp(data[step, rank]).square().mean().backward()
            opt.step()
            opt.zero_grad()
        states = [torch.empty_like(_scaling_state(model)) for _ in range(FOUR)]
        dist.all_gather(states, _scaling_state(model))
        apart = te.recipe.DelayedScaling(amax_history_len=4, margin=1 if rank == 3 else 0)
        message = "no error"
        try:
            for _ in range(2):
                with te.autocast(recipe=apart):
                    model(data[0, rank]).square().mean().backward()
        except RuntimeError as err:
            message = str(err)
        messages = [None] * FOUR
        dist.all_gather_object(messages, message)
        if rank == 0:
            results["equal"] = all(torch.equal(states[0], s) for s in states[1:])
            results["messages"] = messages
        dist.barrier()
        results[f"done {rank}"] = True
    finally:
        dist.destroy_process_group()


def test_four_ranks_share_their_scaling_state_and_name_the_odd_one_out():
    shared = spawned(_four_worker, FOUR)
    equal, messages = shared["equal"], shared["messages"]
    assert equal, "four ranks with the default reduction: the scaling states differ"
    for rank, message in enumerate(messages):
        assert "ranks [0, 1, 2] and ranks [3]" in message, f"rank {rank}: {message}"
        assert f"this rank ({rank})" in message and f"margin={1 if rank == 3 else 0}" in message, message
