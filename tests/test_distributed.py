"""Delayed scaling's amax reduction under torch.distributed, two CPU processes on
gloo (or GPUs on NCCL, see ``dist_testing``), trained as users train: a te_fuser
model in DDP, fused AdamW-style steps on each rank's own half of the batch.

With ``reduce_amax=True`` (the default) and no group given, the amaxes are
all-reduced over the default process group, so every rank holds the same scaling
state (the same scales, histories and FP8 casts), in two collectives a step (the
forward's amaxes together, then the backward's); ``reduce_amax=False`` keeps each
rank's own; a group given to ``te.autocast`` is used instead; a process group
initialized after the model first ran counts from then on.

Also: FSDP2 per layer round-trips through torch.distributed.checkpoint with the
scaling state (two ranks and four); a recipe schedule (bf16 -> delayed ->
current -> bf16) on two ranks, in DDP and in FSDP2 per layer, is one process on
the whole batch within the tolerance table; FSDP2 per layer trains as DDP, bit
for bit, under every recipe of tests/op_testing.py; FP8 parameters accumulate
(``no_sync``) and clip in DDP and FSDP2 as one process on the whole batch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_testing import device, device_type, gathered, init, spawned

WORLD = 2
CASES = ("default", "no_reduction", "given_group", "checkpointed", "rank0_validates", "initialized_late")


def _model():
    import te_fuser as te

    torch.manual_seed(0)
    return te.ops.Sequential(te.ops.LayerNorm(32), te.ops.Linear(32, 64), te.ops.GELU(),
                             te.ops.Linear(64, 32)).to(device())


class _Checkpointed(torch.nn.Module):
    """``inner`` run under te.checkpoint (its activations recomputed in the backward)."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        import te_fuser as te

        return te.checkpoint(self.inner, x)


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

    model = _model() if case != "checkpointed" else _Checkpointed(_model())
    recipe = te.recipe.DelayedScaling(amax_history_len=4, reduce_amax=case != "no_reduction")
    group = dist.new_group(list(range(WORLD))) if case == "given_group" else None
    data = torch.randn(4, WORLD, 16, 32, generator=torch.Generator().manual_seed(7))
    data[:, 1] *= 3.0  # rank 1's inputs (and so its gradients) are larger: unreduced amaxes differ
    data = data.to(device())
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    calls, all_reduce = [], dist.all_reduce

    def counted(*args, **kwargs):  # DDP's gradient buckets reduce in C++: these are te_fuser's
        calls[-1] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    try:
        for step in range(4):
            if case == "rank0_validates" and rank == 0 and step in (0, 2):  # before the first step too: unseeded
                model.eval()  # through the inner model, as a user's rank-0 validation does
                with torch.no_grad(), te.autocast(recipe=recipe, amax_reduction_group=group):
                    model(data[step, rank] * 5.0)
                model.train()
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
    """The ranks switch at one step, rank 1 to another margin than rank 0 (the same
    recipe class): their first training plans compare the keys and stop both,
    naming the ranks."""
    import te_fuser as te

    model = _model()
    recipe = te.recipe.DelayedScaling(amax_history_len=4, margin=2 + rank)
    try:
        for _ in range(2):
            with te.autocast(recipe=recipe):
                model(torch.randn(16, 32, device=device())).square().mean().backward()
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
        model(torch.randn(16, 32, generator=torch.Generator().manual_seed(rank)).to(device()) * (1 + 2 * rank))
    folder, name = os.path.split(store_file)
    init(rank, WORLD, folder, name)
    data = torch.randn(5, WORLD, 16, 32, generator=torch.Generator().manual_seed(9))
    data[:, 1] *= 3.0
    data = data.to(device())
    for step in range(5):
        with te.autocast(recipe=recipe):
            model(data[step, rank]).square().mean().backward()
    return _scaling_state(model), torch.zeros(1)


def _worker(rank: int, folder: str, results) -> None:
    init(rank, WORLD, folder)
    try:
        trained = {}
        for case in CASES[:-1]:
            state, weights, calls = trained[case] = _train(rank, case)
            states, all_weights = gathered(state), gathered(weights)
            if rank == 0:
                results[case] = (torch.equal(*states), torch.equal(*all_weights))
                results[f"{case} collectives"] = calls
        if rank == 0:
            results["checkpointed as default"] = tuple(torch.equal(a, b) for a, b in
                                                       zip(trained["checkpointed"][:2], trained["default"][:2]))
            state, weights, calls = trained["rank0_validates"]
            results["rank0_validates as default"] = (torch.equal(state, trained["default"][0]),
                                                     torch.equal(weights, trained["default"][1]),
                                                     calls == trained["default"][2])
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
    return spawned(_worker, WORLD, gpus=True)


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


def test_ddp_over_a_checkpointed_model_trains_as_without_and_reduces_alike(results):
    """DDP over a model whose Sequential runs under te.checkpoint: the ranks agree, the
    scaling state and weights are the default run's bit for bit, and the amaxes go in
    the same collectives (a recomputation records none)."""
    assert results["checkpointed"] == (True, True)
    assert results["checkpointed as default"] == (True, True)
    assert results["checkpointed collectives"] == results["default collectives"]


def test_a_validation_on_rank_0_alone_waits_for_no_one_and_changes_nothing(results):
    """Rank 0 alone validates under the recipe (the model in evaluation mode, its
    inner module as a user's rank-0 validation calls it), before the first step
    and mid-training: an evaluation forward records no amax, so it starts no
    reduction the other rank would have to join (the unseeded one seeds for itself),
    and both ranks train exactly as without it: the same scaling state, weights and
    collectives a step."""
    assert results["rank0_validates"] == (True, True)
    assert results["rank0_validates as default"] == (True, True, True)


def test_ranks_under_different_recipes_stop_with_an_error_naming_them(results):
    message = results["mismatch"]
    assert "ranks train under different recipes" in message and "ranks [0] and ranks [1]" in message, message
    assert "margin=2" in message, message  # this rank's own recipe key


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


def _dcp_round_trip(rank: int, folder: str, world: int = WORLD) -> tuple[bool, bool, bool]:
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

    mesh = init_device_mesh(device_type(), (world,))
    recipe = te.recipe.DelayedScaling(amax_history_len=4)
    data = torch.randn(4, world, 16, 32, generator=torch.Generator().manual_seed(3))
    data *= torch.arange(1, world + 1).reshape(1, world, 1, 1)  # every rank's amaxes differ
    data = data.to(device())
    model = te.apply_recipe(_fsdp_model(mesh), recipe, example_inputs=(data[0, rank],))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        model(data[step, rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    checkpoint = os.path.join(folder, f"ckpt{world}")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=checkpoint)
    fresh = te.apply_recipe(_fsdp_model(mesh), recipe, example_inputs=(data[0, rank],))
    state = {"model": get_model_state_dict(fresh)}
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(fresh, state["model"])
    loss = model(data[3, rank]).square().mean()
    fresh_loss = fresh(data[3, rank]).square().mean()
    weights = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters()))
    return torch.equal(_scaling_state(model), _scaling_state(fresh)), weights, torch.equal(loss, fresh_loss)


def _dcp_worker(rank: int, folder: str, results) -> None:
    init(rank, WORLD, folder, "dcp_store")
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
    outcomes = spawned(_dcp_worker, WORLD, gpus=True)["dcp"]
    for rank, (state, weights, loss) in enumerate(outcomes):
        assert weights, f"rank {rank}: the loaded weights differ"
        assert state, f"rank {rank}: the loaded scaling state differs"
        assert loss, f"rank {rank}: the next step's loss differs after the load"


# -- four processes ------------------------------------------------------------------

FOUR = 4


def _four_worker(rank: int, folder: str, results) -> None:
    """Four ranks in DDP under delayed scaling with the default reduction, every
    rank on its own data: their scaling states equal; then rank 3 alone trains
    under another margin (the others switching too), and every rank stops naming the
    two sets of ranks; then
    FSDP2 per layer round-trips through DCP on the four ranks."""
    import te_fuser as te
    from torch.nn.parallel import DistributedDataParallel as DDP

    init(rank, FOUR, folder, "store4")
    try:
        model = _model()
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        recipe = te.recipe.DelayedScaling(amax_history_len=4)
        data = torch.randn(3, FOUR, 8, 32, generator=torch.Generator().manual_seed(5))
        data *= torch.arange(1, FOUR + 1).reshape(1, FOUR, 1, 1)  # every rank's amaxes differ
        data = data.to(device())
        for step in range(3):
            with te.autocast(recipe=recipe):
                ddp(data[step, rank]).square().mean().backward()
            opt.step()
            opt.zero_grad()
        states = [torch.empty_like(_scaling_state(model)) for _ in range(FOUR)]
        dist.all_gather(states, _scaling_state(model))
        apart = te.recipe.DelayedScaling(amax_history_len=4, margin=3 if rank == 3 else 2)  # all switch, one apart
        message = "no error"
        try:
            for _ in range(2):
                with te.autocast(recipe=apart):
                    model(data[0, rank]).square().mean().backward()
        except RuntimeError as err:
            message = str(err)
        messages = [None] * FOUR
        dist.all_gather_object(messages, message)
        outcomes = [None] * FOUR
        dist.all_gather_object(outcomes, _dcp_round_trip(rank, folder, FOUR))
        if rank == 0:
            results["equal"] = all(torch.equal(states[0], s) for s in states[1:])
            results["messages"] = messages
            results["dcp"] = outcomes
        dist.barrier()
        results[f"done {rank}"] = True
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def four():
    return spawned(_four_worker, FOUR, gpus=True)


def test_four_ranks_in_fsdp2_per_layer_checkpoint_through_dcp_with_the_scaling_state(four):
    for rank, (state, weights, loss) in enumerate(four["dcp"]):
        assert weights and state and loss, f"rank {rank} of 4: (state, weights, next loss) equal: {(state, weights, loss)}"


def test_four_ranks_share_their_scaling_state_and_name_the_odd_one_out(four):
    shared = four
    equal, messages = shared["equal"], shared["messages"]
    assert equal, "four ranks with the default reduction: the scaling states differ"
    for rank, message in enumerate(messages):
        assert "ranks [0, 1, 2] and ranks [3]" in message, f"rank {rank}: {message}"
        assert f"this rank ({rank})" in message and f"margin={3 if rank == 3 else 2}" in message, message


# -- a recipe schedule on two ranks against one process on the whole batch -----------

SCHEDULE = ("bf16", "bf16", "delayed", "delayed", "current", "current", "bf16", "bf16")
_LR = 0.1


def _phase(name: str):
    """The regions a step of phase ``name`` runs in: te.autocast's and torch's."""
    import contextlib

    import te_fuser as te

    if name == "bf16":
        return te.autocast(enabled=False), torch.autocast(device_type(), dtype=torch.bfloat16)
    recipe = {"delayed": _DELAYED, "current": _CURRENT}[name]
    return te.autocast(recipe=recipe), contextlib.nullcontext()


def _recipes():
    import te_fuser as te

    global _DELAYED, _CURRENT
    _DELAYED, _CURRENT = te.recipe.DelayedScaling(amax_history_len=4), te.recipe.Float8CurrentScaling()


def _schedule_run(rank: int, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch's loss at every step of SCHEDULE and the weights after it:
    ``how`` is 'one' (this process alone on the whole batch), 'ddp' or 'fsdp2' (every
    op then the root sharded), each rank on its half. SGD, so the weights move by
    the gradients themselves."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    if how == "ddp":
        run = DDP(model)
    elif how == "fsdp2":
        run = model = _fsdp_model(init_device_mesh(device_type(), (WORLD,)))
    else:
        run = model
    opt = torch.optim.SGD(model.parameters(), lr=_LR)
    data = torch.randn(len(SCHEDULE), WORLD * 16, 32, generator=torch.Generator().manual_seed(11))
    data[:, 16:] *= 3.0  # rank 1's half is larger: its current-scaling amaxes are the global ones
    data = data.to(device())
    losses = []
    for step, name in enumerate(SCHEDULE):
        x = data[step] if how == "one" else data[step].chunk(WORLD)[rank]
        region, torch_region = _phase(name)
        with region, torch_region:
            loss = run(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if how != "one":
            loss = sum(gathered(loss.detach().reshape(1))) / WORLD  # the halves are equal: the global mean
        losses.append(loss.detach().reshape(()))
    weights = [p.full_tensor() if how == "fsdp2" else p for p in model.parameters()]
    return torch.stack(losses).cpu(), torch.cat([w.detach().reshape(-1) for w in weights]).cpu()


# -- FSDP2 per layer under every recipe ---------------------------------------------------


def _every_recipe(rank: int) -> dict:
    """Each recipe of tests/op_testing.py: FSDP2 per layer and DDP on the same ranks
    and data, two AdamW steps: (losses equal, weights equal, scaling states equal
    across the ranks). Shapes are multiples of 128 (the block recipes' tiles)."""
    import te_fuser as te
    from op_testing import RECIPES
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    def build():
        torch.manual_seed(0)
        return te.ops.Sequential(te.ops.LayerNorm(128), te.ops.Linear(128, 256), te.ops.GELU(),
                                 te.ops.Linear(256, 128)).to(device())

    mesh = init_device_mesh(device_type(), (WORLD,))
    data = torch.randn(2, WORLD, 128, 128, generator=torch.Generator().manual_seed(5))
    data[:, 1] *= 2.0
    data = data.to(device())
    outcome = {}
    for name, recipe in RECIPES.items():
        runs = []
        for sharded in (True, False):
            model = build()
            if sharded:
                for module in model:
                    fully_shard(module, mesh=mesh)
                fully_shard(model, mesh=mesh)
            run = model if sharded else DDP(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for step in range(2):
                with te.autocast(enabled=recipe is not None, recipe=recipe):
                    loss = run(data[step, rank]).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            weights = [p.full_tensor() if sharded else p for p in model.parameters()]
            state = _scaling_state(model) if any(
                q.state_tensors() for op in model.modules() for q in getattr(op, "installed_quantizers", {}).values()
            ) else torch.zeros(1, device=device())
            runs.append((torch.stack(losses), torch.cat([w.detach().reshape(-1) for w in weights]), state))
        (f_losses, f_weights, f_state), (d_losses, d_weights, _) = runs
        outcome[name] = (torch.equal(f_losses, d_losses), torch.equal(f_weights, d_weights),
                         all(torch.equal(s, f_state) for s in gathered(f_state)))
    return outcome


def _schedule_worker(rank: int, folder: str, results) -> None:
    init(rank, WORLD, folder)
    try:
        _recipes()
        runs = {how: _schedule_run(rank, how) for how in ("one", "ddp", "fsdp2")}
        recipes = _every_recipe(rank)
        fp8_parameters = _fp8_parameters_runs(rank)
        if rank == 0:
            results["schedule"] = runs
            results["every recipe"] = recipes
            results["fp8 parameters"] = fp8_parameters
        dist.barrier()
        results[f"done {rank}"] = True
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def schedule():
    return spawned(_schedule_worker, WORLD, gpus=True)


@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
def test_a_recipe_schedule_on_two_ranks_is_one_process_on_the_whole_batch(schedule, how):
    """bf16 -> delayed -> current -> bf16, two steps each, against one process on the
    global batch, within the tolerance table (a phase's losses under its format,
    the weights under E4M3's, the format whose casts part them; measured: losses within 9e-5 relative outside the
    current-scaling phase, 6.7e-3 in it, weights within 5e-5). Not bit for bit: each rank's weight gradient sums
    over its half of the batch and the halves are then averaged (another order of
    fp32 additions than one sum over the batch); under current scaling each rank
    casts its half with the scale of its own amax, where one process casts the
    whole batch with the larger one (delayed scaling's reduced amax is the global
    batch's, so its casts are the one process's)."""
    from tolerances import assert_close

    one_losses, one_weights = schedule["schedule"]["one"]
    losses, weights = schedule["schedule"][how]
    for step, name in enumerate(SCHEDULE):
        key = torch.bfloat16 if name == "bf16" else torch.float8_e4m3fn
        assert_close(losses[step], one_losses[step], key, f"{how}, step {step} ({name}): the global batch's loss")
    assert_close(weights, one_weights, torch.float8_e4m3fn, f"{how}: the weights after the schedule")
    assert not torch.equal(weights, _model_weights()), "the schedule trained nothing"


def _model_weights() -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in _model().parameters()])


@pytest.mark.parametrize("name", ["none", "delayed", "current", "mxfp8", "block", "rowwise", "custom_identity",
                                  "delayed_mha", "current_mha"])
def test_fsdp2_per_layer_trains_as_ddp_under_every_recipe(schedule, name):
    """The same local computations and an average of two gradients either way: bit
    for bit, and the ranks' scaling states (delayed scaling's amaxes) equal."""
    from op_testing import RECIPES

    assert set(RECIPES) == set(schedule["every recipe"])
    losses, weights, states = schedule["every recipe"][name]
    assert losses, f"{name}: FSDP2 per layer's losses differ from DDP's"
    assert weights, f"{name}: FSDP2 per layer's weights differ from DDP's"
    assert states, f"{name}: the ranks' scaling states differ"


# -- FP8 parameters under DDP and FSDP2, with gradient accumulation ------------------


def _fp8_parameters_run(rank: int, how: str, name: str) -> tuple:
    """A model made under ``te.quantized_model_init`` (FP8 weights, the masters in
    AdamW's state) trained as users train: two micro-batches a step (DDP's first
    under ``no_sync``, its gradient buckets the ``.grad`` views), the gradients
    clipped, fused AdamW where the parameters are plain tensors. ``how``: 'one'
    (this process on the global micro-batches), 'ddp', 'fsdp2' (every op then the
    root sharded) or 'fsdp2_fp8_all_gather' (``te.enable_fsdp_fp8_all_gather`` before
    the sharding), each rank on its half. The losses of the global micro-batches,
    the weights before and after (dequantized), whether every weight is still FP8,
    the warnings' messages and the forward all-gathers that went in FP8."""
    import warnings

    import te_fuser as te
    from te_fuser.quantization.float8_tensor import Float8Tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    recipe = {"delayed": _DELAYED, "current": _CURRENT}[name]
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=recipe):
        model = te.ops.Sequential(te.ops.LayerNorm(32), te.ops.Linear(32, 64), te.ops.GELU(),
                                  te.ops.Linear(64, 32)).to(device())
    start = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).cpu()
    run = model
    if how == "ddp":
        run = DDP(model, gradient_as_bucket_view=True)
    elif how.startswith("fsdp2"):
        if how == "fsdp2_fp8_all_gather":
            te.enable_fsdp_fp8_all_gather(model)
        mesh = init_device_mesh(device_type(), (WORLD,))
        for module in model:
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=not how.startswith("fsdp2"))
    data = torch.randn(3, 2, WORLD * 16, 32, generator=torch.Generator().manual_seed(13))
    data[..., 16:, :] *= 3.0  # rank 1's half is larger: the ranks' current-scaling amaxes differ
    data = data.to(device())
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fp8_parameters_steps(rank, how, recipe, model, run, opt, data, losses)
    weights = [p.full_tensor() if how.startswith("fsdp2") else p for p in model.parameters()]
    fp8 = all(isinstance(w, Float8Tensor) for w in weights if w.dim() == 2)
    flat = torch.cat([w.detach().float().reshape(-1) for w in weights])
    fp8_gathers = te.fp8_all_gather_stats(model)["fp8"] if how == "fsdp2_fp8_all_gather" else 0
    return torch.stack(losses).cpu(), start, flat.cpu(), fp8, [str(w.message) for w in caught], fp8_gathers


def _fp8_parameters_steps(rank: int, how: str, recipe, model, run, opt, data, losses: list) -> None:
    import contextlib

    import te_fuser as te

    for step in range(data.shape[0]):
        for micro in range(2):
            x = data[step, micro] if how == "one" else data[step, micro].chunk(WORLD)[rank]
            accumulating = how == "ddp" and micro == 0
            with run.no_sync() if accumulating else contextlib.nullcontext():
                with te.autocast(recipe=recipe):
                    loss = run(x).float().square().mean()
                (loss / 2).backward()
            if how != "one":
                loss = sum(gathered(loss.detach().reshape(1))) / WORLD
            losses.append(loss.detach().reshape(()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def _fp8_parameters_runs(rank: int) -> dict:
    """Each way of :func:`_fp8_parameters_run` under delayed and current scaling, and
    whether the ranks' weights agree after it."""
    runs = {(how, name): _fp8_parameters_run(rank, how, name)
            for how in ("one", "ddp", "fsdp2", "fsdp2_fp8_all_gather") for name in ("delayed", "current")}
    same = {key: all(torch.equal(w, run[2]) for w in gathered(run[2])) for key, run in runs.items()}
    return {"runs": runs, "ranks agree": same}


@pytest.mark.parametrize("name", ["delayed", "current"])
@pytest.mark.parametrize("how", ["ddp", "fsdp2", "fsdp2_fp8_all_gather"])
def test_fp8_parameters_accumulate_and_clip_in_ddp_and_fsdp2_as_one_process(schedule, how, name):
    """FP8 weights in DDP (``no_sync`` accumulation, bucket views) and in FSDP2 per
    layer: the ranks hold the same weights and the run is one process on the global
    batch within E4M3's bounds (each rank's gradient sums its half, and current
    scaling casts each half with its own amax). In DDP every weight stays FP8.
    FSDP2's shards are plain tensors, which each linear says once; with
    ``te.enable_fsdp_fp8_all_gather`` first (the route that warning names) nothing is
    said and the run is FSDP2's without it, bit for bit, the weights gathered in FP8."""
    from tolerances import assert_close

    fp8_parameters = schedule["fp8 parameters"]
    one_losses, start, one_weights, _, one_warned, _ = fp8_parameters["runs"][("one", name)]
    losses, _, weights, fp8, warned, fp8_gathers = fp8_parameters["runs"][(how, name)]
    replaced = [m for m in warned if "made under te.quantized_model_init" in m]
    assert not any("quantized_model_init" in m for m in one_warned), one_warned
    if how == "ddp":
        assert fp8 and not replaced, f"ddp, {name}: a weight is no longer an FP8 parameter after the steps"
    elif how == "fsdp2":
        assert not fp8 and len(replaced) == 2, f"fsdp2, {name}: each linear warns once, got {replaced}"
        assert "plain float32 tensor" in replaced[0] and "enable_fsdp_fp8_all_gather" in replaced[0], replaced[0]
    else:
        assert not replaced and fp8_gathers > 0, f"{how}, {name}: {replaced}, {fp8_gathers} FP8 gathers"
        plain_losses, _, plain_weights, *_ = fp8_parameters["runs"][("fsdp2", name)]
        assert torch.equal(losses, plain_losses) and torch.equal(weights, plain_weights), (
            f"{how}, {name}: not FSDP2's run without the FP8 all-gather")
    assert fp8_parameters["ranks agree"][(how, name)], f"{how}, {name}: the ranks' weights differ"
    assert_close(losses, one_losses, torch.float8_e4m3fn, f"{how}, {name}: the global micro-batches' losses")
    assert_close(weights, one_weights, torch.float8_e4m3fn, f"{how}, {name}: the weights after three steps")
    assert not torch.equal(weights, start), f"{how}, {name}: the steps trained nothing"


# -- the multi-GPU benchmark, at smoke size on CPU -------------------------------------


def _bench_worker(rank: int, folder: str, results) -> None:
    import argparse
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_distributed

    out = os.path.join(folder, "bench.json")
    bench_distributed.run(rank, WORLD, argparse.Namespace(
        arms=list(bench_distributed.ARMS), recipe="current", steps=1, timed=1, smoke=True, json=out, no_csv=True))
    if rank == 0:
        import json

        results["bench"] = json.loads(pathlib.Path(out).read_text())
    results[f"done {rank}"] = True


def test_the_distributed_benchmark_runs_on_cpu_and_counts_the_fp8_all_gather_bytes(monkeypatch):
    """benchmarks/bench_distributed.py (torchrun on two GPUs later) at smoke size on
    two gloo ranks: every arm trains, and the FP8 all-gather sends one byte per
    linear weight element where the bf16 gathers send two."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(sock.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    import te_fuser as te
    from te_fuser.models.gpt import GPT, GPTConfig

    arms = {a["arm"]: a for a in spawned(_bench_worker, WORLD)["bench"]["arms"]}
    linear_weights = sum(op.weight.numel() for op in GPT(GPTConfig.smoke()).modules()
                         if isinstance(op, te.ops.BasicLinear))
    gathers = 2  # forward and backward, each rank sending its half
    bf16, fp8, fp8_all_gather = (arms[a]["all_gather_bytes_per_step"] for a in ("bf16", "fp8", "fp8_all_gather"))
    assert bf16 == fp8 and bf16 - fp8_all_gather == gathers * linear_weights // WORLD, arms
    assert arms["fp8_all_gather"]["gathers"]["fp8"] > 0 and all(a["tokens_per_s_per_gpu"] > 0 for a in arms.values())
