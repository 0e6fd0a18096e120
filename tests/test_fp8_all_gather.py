"""FSDP2 all-gathers the linears' weights in FP8 (``te.enable_fsdp_fp8_all_gather``),
two CPU processes on gloo, trained as users train: ``fully_shard`` on every op then
the root, AdamW, a recipe schedule.

What is checked: the bytes FSDP2's all-gathers send (counted at the collective)
are half of a bf16 gather's and a quarter of an fp32 one's; training with the FP8
all-gather is the training without it bit for bit (losses, sharded gradients,
weights, scaling state) through delayed scaling, current scaling, a bf16 phase
and delayed scaling again, with validation passes in evaluation mode between steps; after an optimizer step the gathered FP8 weight is
the cast of the new weight; a high-precision forward gets the high-precision
weight; a gather that went FP8 for a recipe the step did not run is gathered
again in high precision by the linear."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from dist_testing import init, spawned

from te_fuser.ops.fp8_all_gather import ALL_GATHER_NAME

WORLD = 2


def _model(linears_only: bool = False):
    import te_fuser as te

    torch.manual_seed(0)
    if linears_only:
        return te.ops.Sequential(te.ops.BasicLinear(64, 96), te.ops.GELU(), te.ops.BasicLinear(96, 64))
    return te.ops.Sequential(te.ops.LayerNorm(64), te.ops.Linear(64, 96), te.ops.GELU(), te.ops.Linear(96, 64))


def _sharded(model, fp8_all_gather: bool, per_op: bool = True, mp_policy=None):
    import te_fuser as te
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    policy = mp_policy or MixedPrecisionPolicy()
    if fp8_all_gather:
        te.enable_fsdp_fp8_all_gather(model)
    if per_op:
        for module in model:
            if any(True for _ in module.parameters()):
                fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@contextlib.contextmanager
def _counted_all_gathers(sent: list):
    """Every all-gather's input bytes (what a rank puts on the wire), appended to ``sent``."""
    all_gather = getattr(dist, ALL_GATHER_NAME)

    def counted(output_tensor, input_tensor, *args, **kwargs):
        sent.append(input_tensor.numel() * input_tensor.element_size())
        return all_gather(output_tensor, input_tensor, *args, **kwargs)

    setattr(dist, ALL_GATHER_NAME, counted)
    try:
        yield
    finally:
        setattr(dist, ALL_GATHER_NAME, all_gather)


def _recipe_context(recipe):
    import te_fuser as te

    if recipe == "bf16":
        return contextlib.ExitStack(), torch.autocast("cpu", dtype=torch.bfloat16)
    return te.autocast(enabled=recipe is not None, recipe=recipe), contextlib.nullcontext()


def _bytes_per_step(rank: int, fp8_all_gather: bool, param_dtype) -> list[int]:
    """The all-gather bytes of each of four current-scaling steps of a model of two
    linears (no other parameters)."""
    import te_fuser as te
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _sharded(_model(linears_only=True), fp8_all_gather, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(rank))
    per_step = []
    for step in range(4):
        sent: list = []
        with _counted_all_gathers(sent):
            with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
                loss = model(x[step]).float().square().mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        per_step.append(sum(sent))
    return per_step


SCHEDULE = ("delayed", "delayed", "delayed", "current", "current", "current", "bf16", "bf16", "delayed", "delayed")
VALIDATED = (1, 4, 8)  # steps followed by a validation pass in evaluation mode


def _schedule_recipe(name):
    import te_fuser as te

    return {"delayed": te.recipe.DelayedScaling(amax_history_len=4), "current": te.recipe.Float8CurrentScaling(),
            "bf16": "bf16"}[name]


def _scaling_state(model) -> torch.Tensor:
    parts = [torch.zeros(0)]
    for op in model.modules():
        for q in getattr(op, "installed_quantizers", {}).values():
            parts += [t.reshape(-1).float() for t in q.state_tensors().values()]
    return torch.cat(parts)


def _train_schedule(rank: int, fp8_all_gather: bool, checkpointed: bool = False) -> dict:
    """Train through SCHEDULE: the losses, the sharded gradients of every step, the
    weights and the scaling state at the end, and the gather counts. ``checkpointed``:
    the model runs under te.checkpoint (the recomputation gathers and casts the
    shards again, with the forward's scales)."""
    import te_fuser as te

    model = _sharded(_model(), fp8_all_gather)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(len(SCHEDULE), WORLD, 16, 64, generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    recipes = {name: _schedule_recipe(name) for name in set(SCHEDULE)}
    for step, name in enumerate(SCHEDULE):
        region, torch_autocast = _recipe_context(recipes[name])
        with region, torch_autocast:
            y = te.checkpoint(model, x[step, rank]) if checkpointed else model(x[step, rank])
            loss = y.float().square().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.to_local().detach().reshape(-1) for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
        if step in VALIDATED:  # a validation pass under the step's recipe: its gathers record nothing
            model.eval()
            with torch.no_grad(), region, torch_autocast:
                model(x[step, rank])
            model.train()
    weights = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    return {"losses": torch.stack(losses), "grads": torch.stack(grads), "weights": weights,
            "state": _scaling_state(model), "stats": te.fp8_all_gather_stats(model)}


def _fresh_after_step(rank: int) -> dict:
    """Current scaling with the FP8 all-gather: at each forward, the FP8 weight the
    linear receives (seen by a forward pre-hook after FSDP2's) against the cast of
    the weight as it is then (gathered in high precision beforehand)."""
    import te_fuser as te
    from te_fuser.quantization import Float8CurrentScalingQuantizer

    model = _sharded(_model(), True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    linear = model[1]
    seen = []

    def look(module, args):  # the gathered weight is freed after the forward: copy it now
        w = module.linear.weight
        data = w.quantized(w.quantizer, False).rowwise.data.view(torch.uint8).clone() if w.is_fp8 else None
        seen.append((w.is_fp8, data, w.value().clone()))

    linear.register_forward_pre_hook(look)
    recipe = te.recipe.Float8CurrentScaling()
    cast = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    x = torch.randn(5, 16, 64, generator=torch.Generator().manual_seed(rank))
    out = {"fresh": [], "changed": [], "fp8": [], "hp_forward": None}
    previous = None
    for step in range(5):
        if step == 3:  # a write no version counter sees, between two steps
            for p in model.parameters():
                p.data.mul_(0.5)
        expected = cast(linear.weight.full_tensor()).rowwise.data.view(torch.uint8)
        with te.autocast(recipe=recipe):
            loss = model(x[step]).square().mean()
        is_fp8, got, _ = seen[-1]
        out["fp8"].append(is_fp8)
        if got is not None:
            out["fresh"].append(torch.equal(got, expected))
            out["changed"].append(previous is not None and not torch.equal(got, previous))
            previous = got
        loss.backward()
        opt.step()
        opt.zero_grad()
    full = linear.weight.full_tensor()
    with torch.no_grad(), te.autocast(enabled=False):
        model(x[0])
    is_fp8, _, value = seen[-1]
    out["hp_forward"] = (is_fp8, torch.equal(value, full))
    return out


def _regathered(rank: int, fp8_all_gather: bool) -> tuple:
    """The root alone sharded; the user unshards it ahead of a step (as a prefetch
    would) under delayed scaling's prediction, then the step runs current scaling:
    the linear gathers its weight again in high precision and casts it."""
    import te_fuser as te

    model = _sharded(_model(), fp8_all_gather, per_op=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(rank))
    delayed, current = te.recipe.DelayedScaling(amax_history_len=4), te.recipe.Float8CurrentScaling()
    losses = []
    for step, recipe in enumerate((delayed, delayed, current, current)):
        if step == 2:  # gathered ahead, under the region of the steps before
            with te.autocast(recipe=delayed):
                model.unshard()
        with te.autocast(recipe=recipe):
            loss = model(x[step]).square().mean()
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    weights = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    return torch.stack(losses), weights, te.fp8_all_gather_stats(model) if fp8_all_gather else None


def _dcp_round_trip(rank: int, folder: str) -> tuple:
    """A model with its own current-scaling recipe and the FP8 all-gather, saved
    through torch.distributed.checkpoint after FP8 steps and loaded into a fresh
    one: (the weights equal, the next loss equal, the checkpoint's weights plain
    tensors)."""
    import os

    import te_fuser as te
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(rank))

    def build():
        return te.apply_recipe(_sharded(_model(), True), te.recipe.Float8CurrentScaling(), example_inputs=(x[0],))

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        model(x[step]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    checkpoint = os.path.join(folder, "ckpt")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=checkpoint)
    fresh = build()
    state = {"model": get_model_state_dict(fresh)}
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(fresh, state["model"])
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters()))
    loss, fresh_loss = model(x[3]).square().mean(), fresh(x[3]).square().mean()
    saved = os.path.join(folder, f"state{rank}.pt")
    torch.save(model.state_dict(), saved)
    plain = all(type(v.to_local()) is torch.Tensor for k, v in torch.load(saved, weights_only=False).items()
                if k.endswith("weight"))
    return same, torch.equal(loss, fresh_loss), plain, te.fp8_all_gather_stats(model)["fp8"]


def _worker(rank: int, folder: str, results) -> None:
    init(rank, WORLD, folder)
    try:
        sent = {name: _bytes_per_step(rank, fp8, dtype)
                for name, fp8, dtype in (("fp32", False, None), ("bf16", False, torch.bfloat16),
                                         ("fp8", True, None))}
        plain, fp8 = _train_schedule(rank, False), _train_schedule(rank, True)
        fp8_checkpointed = _train_schedule(rank, True, checkpointed=True)
        fresh = _fresh_after_step(rank)
        (plain_losses, plain_weights, _), (losses, weights, stats) = _regathered(rank, False), _regathered(rank, True)
        checkpointed = _dcp_round_trip(rank, folder)
        import te_fuser as te

        try:
            te.enable_fsdp_fp8_all_gather(_sharded(_model(), False))
            late = "no error"
        except RuntimeError as err:
            late = str(err)
        if rank == 0:
            results["late"] = late
            results["dcp"] = checkpointed
            results["bytes"] = sent
            results["schedule"] = {k: (plain[k], fp8[k]) for k in plain}
            results["checkpointed"] = {k: (plain[k], fp8_checkpointed[k]) for k in plain if k != "stats"}
            results["fresh"] = fresh
            results["regathered"] = (torch.equal(plain_losses, losses), torch.equal(plain_weights, weights), stats)
        dist.barrier()
        results[f"done {rank}"] = True
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    return spawned(_worker, WORLD)


def test_the_fp8_all_gather_sends_half_of_bf16_and_a_quarter_of_fp32(results):
    """Steps 2-4 (the first one gathers in high precision: nothing has cast yet):
    every byte FSDP2's all-gathers send is a weight's, one per element in FP8."""
    sent = results["bytes"]
    weights = 2 * 64 * 96  # the two linears' weights, elements
    for step in range(1, 4):
        fp32, bf16, fp8 = sent["fp32"][step], sent["bf16"][step], sent["fp8"][step]
        assert fp8 > 0 and 2 * fp8 == bf16 and 4 * fp8 == fp32, sent
    assert sent["fp32"][1] % (4 * weights // WORLD) == 0, sent  # whole gathers of the weights' shards
    assert sent["fp8"][0] == sent["fp32"][0], sent  # the first step: high precision, the same bytes


def test_training_with_the_fp8_all_gather_is_training_without_it_bit_for_bit(results):
    """delayed -> current -> bf16 -> delayed: the FP8 bytes gathered are those of a
    cast of the whole weight and the scaling state is the one that cast leaves, so
    nothing differs, to the last bit."""
    schedule = results["schedule"]
    for key in ("losses", "grads", "weights", "state"):
        plain, fp8 = schedule[key]
        assert torch.equal(plain, fp8), f"{key}: max difference {(plain - fp8).abs().max().item()}"


def test_training_checkpointed_with_the_fp8_all_gather_is_training_without_either(results):
    """The model under te.checkpoint with the FP8 all-gather, through the same
    schedule: the recomputation's gathers cast each shard with the forward's
    delayed-scaling scale and record nothing, so losses, gradients, weights and
    scaling state are the plain run's to the last bit."""
    for key, (plain, checkpointed) in results["checkpointed"].items():
        assert torch.equal(plain, checkpointed), f"{key}: max difference {(plain - checkpointed).abs().max().item()}"


def test_the_schedule_gathers_fp8_where_a_per_tensor_recipe_ran_the_step_before(results):
    """Two linears; per FP8 phase the first step gathers in high precision (the
    recipe changed), the others in FP8; the bf16 phase in high precision; each
    validation pass after an FP8 step in FP8."""
    stats = results["schedule"]["stats"][1]
    fp8 = 2 * (2 + 2 + 1) + 2 * len(VALIDATED)
    assert stats == {"fp8": fp8, "high_precision": 2 * (1 + 1 + 2 + 1), "regathered": 0}, stats


def test_the_fp8_weight_is_the_cast_of_the_weight_after_each_optimizer_step(results):
    """A stale FP8 weight (the cast of the weight before the step) would differ from
    the cast of the weight as it is, as consecutive steps' casts differ; also
    after a write through ``.data``, which no version counter sees."""
    fresh = results["fresh"]
    assert fresh["fp8"] == [False, True, True, True, True], fresh["fp8"]
    assert fresh["fresh"] == [True, True, True, True], fresh
    assert fresh["changed"] == [False, True, True, True], fresh


def test_a_high_precision_forward_gets_the_high_precision_weight(results):
    is_fp8, equal = results["fresh"]["hp_forward"]
    assert not is_fp8 and equal


def test_a_gather_for_a_recipe_the_step_did_not_run_is_gathered_again(results):
    same_losses, same_weights, stats = results["regathered"]
    assert same_losses and same_weights
    assert stats["regathered"] == 2, stats  # both linears, once


def test_a_model_with_the_fp8_all_gather_round_trips_through_dcp(results):
    same_weights, same_loss, plain, fp8_gathers = results["dcp"]
    assert same_weights and same_loss
    assert plain, "torch.save of the state dict holds the plain tensors the shards wrap"
    assert fp8_gathers > 0, "the model trained with FP8 gathers before the save"


def test_enabling_after_fully_shard_is_an_error_naming_the_order(results):
    assert "already sharded; call it before fully_shard" in results["late"], results["late"]


def test_enabling_twice_keeps_the_weights_and_a_model_without_linears_is_an_error():
    import te_fuser as te

    with pytest.raises(ValueError, match="holds no te_fuser linear"):
        te.enable_fsdp_fp8_all_gather(torch.nn.Linear(4, 4))
    model = te.enable_fsdp_fp8_all_gather(_model())
    assert te.enable_fsdp_fp8_all_gather(model) is model  # twice: the same weights


def _one_rank_worker(rank, folder, results):
    """cast_shard over a group of one rank: the bytes and scaling state of a cast of
    the whole tensor, and no collective (the one shard is the whole tensor)."""
    import te_fuser as te
    from te_fuser.quantization import QuantizerRole

    init(rank, 1, folder)
    try:
        calls = []
        all_reduce = dist.all_reduce

        def counted(*args, **kwargs):
            calls.append(1)
            return all_reduce(*args, **kwargs)

        x = torch.randn(48, 32, generator=torch.Generator().manual_seed(3))
        same = {}
        for name, recipe in (("delayed", te.recipe.DelayedScaling()), ("current", te.recipe.Float8CurrentScaling())):
            sharded, whole = (recipe.make_quantizer(QuantizerRole("linear", "weight")) for _ in range(2))
            dist.all_reduce = counted
            try:
                for _ in range(3):  # unseeded, then seeded (delayed): each cast records into the state
                    data, scale_inv = sharded.cast_shard(x, dist.group.WORLD)
                    expected = whole.cast(x, rowwise=True, columnwise=False)
                    same.setdefault(name, []).append(
                        torch.equal(data.view(torch.uint8), expected.rowwise.data.view(torch.uint8))
                        and torch.equal(scale_inv, expected.rowwise.scale_inv))
            finally:
                dist.all_reduce = all_reduce
            if name == "delayed":
                same[name].append(torch.equal(sharded.scale, whole.scale))
        results["same"], results["collectives"] = same, len(calls)
        results[f"done {rank}"] = True
    finally:
        dist.destroy_process_group()


def test_a_group_of_one_rank_casts_its_shard_as_the_whole_tensor_without_a_collective():
    got = spawned(_one_rank_worker, 1)
    assert got["same"] == {"delayed": [True, True, True, True], "current": [True, True, True]}, got["same"]
    assert got["collectives"] == 0, got


def test_a_shard_behaves_as_its_tensor_under_every_argument_form():
    """The shard wrapper's ops unwrap it wherever an op takes it: alone, in a list, in
    a keyword, in lists of lists and named tuples (the pytree walk); FSDP2's ops
    (split, view, copy_) keep the wrapper around their results, the rest return
    plain tensors of the same values."""
    import collections

    from te_fuser.ops.fp8_all_gather import Float8AllGatherShard, _replaced, _WeightGather

    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    y = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    g = _WeightGather("w")
    s = Float8AllGatherShard(x.clone(), g)
    assert type(s + y) is torch.Tensor and torch.equal(s + y, x + y)
    assert torch.equal(torch.add(y, s, alpha=2.0), torch.add(y, x, alpha=2.0))
    t = Float8AllGatherShard(torch.zeros(6, 4), g)
    torch.ops.aten.add.out(x, y, out=t)  # the shard a keyword argument
    assert torch.equal(t._data, x + y)
    assert torch.equal(torch.cat([y, s]), torch.cat([y, x]))  # in a list
    assert torch.equal(torch.stack((s, s), dim=0), torch.stack((x, x), dim=0))  # in a tuple
    pieces = torch.split(s, 2)
    assert all(type(p) is Float8AllGatherShard and p._gather is g for p in pieces)
    assert all(torch.equal(p._data, q) for p, q in zip(pieces, torch.split(x, 2)))
    assert type(s.view(4, 6)) is Float8AllGatherShard and torch.equal(s.view(4, 6)._data, x.view(4, 6))
    nested = torch.ops.aten._foreach_add.List([s, y], [y, s])  # two lists: the loop's own case
    assert all(torch.equal(a, b) for a, b in zip(nested, [x + y, y + x]))
    Pair = collections.namedtuple("Pair", "a b")
    args, kwargs = _replaced(Float8AllGatherShard, (Pair(s, 1), [[s]]), {"k": {"s": s}}, lambda t: t._data)
    assert args[0].a is s._data and args[1][0][0] is s._data and kwargs["k"]["s"] is s._data  # the pytree walk
    s.mul_(2.0)  # an optimizer's in-place update reaches the wrapped tensor
    assert torch.equal(s._data, 2 * x)
