"""Ranks agree on the recipe before they train under it.

A rank that switches recipe alone would train on different numerics than the
others, or wait forever in a collective they never join (delayed scaling's amax
reduction). So the first time a rank builds a training plan (one with a backward)
for a recipe, while the default process group has several ranks, it publishes
the recipe's key in the group's store as its n-th new recipe and waits until
every rank has published its n-th: ranks that switched together to one recipe
pass at once; ranks that switched to different ones stop at once with an error
naming the groups of ranks and this rank's key; a rank that switched alone stops
after :data:`AGREEMENT_TIMEOUT_S` with an error naming the ranks that did not
follow and the recipe they last trained under. Never on the hot path: a recipe
agreed once is not checked again in that group. Keys are compared with the per-object numbers of unkeyed
callables removed (those differ between processes by design). Same-class
changes that only delayed scaling's reduction would see are also compared there
(``quantization/amax_reduction.py``).
"""

from __future__ import annotations

from datetime import timedelta

import torch

from .callable_key import strip_fallback_tokens

__all__ = ["check_ranks_agree", "different_recipes", "AGREEMENT_TIMEOUT_S", "casts_beside_collectives"]

# How long a rank that built a recipe's first training plan waits for every other
# rank to build its own next one (seconds; a module attribute to set).
AGREEMENT_TIMEOUT_S = 300.0

_agreed: dict = {}  # process group -> (the recipe keys its ranks agreed on, the count of checks so far)


def _default_group_and_store():
    try:
        import torch.distributed as dist
    except ImportError:
        return None, None, None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None, None, None
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    return dist, dist.group.WORLD, (get_store() if get_store is not None else None)


def check_ranks_agree(recipe_key: str) -> None:
    """Return once every rank of the default group has built its next new training
    recipe and it is ``recipe_key`` (at once when agreed before, or without several
    ranks); else raise ``RuntimeError`` naming the ranks and recipes."""
    dist, group, store = _default_group_and_store()
    if store is None:
        return
    agreed, count = _agreed.setdefault(group, (set(), [0]))
    if recipe_key in agreed:
        return
    key = strip_fallback_tokens(recipe_key)
    rank, world = dist.get_rank(), dist.get_world_size()
    # store keys unique to this group (a job may make several) and to this check
    prefix = f"te_fuser/recipes/{getattr(dist.distributed_c10d._world, 'group_count', 0)}"
    names = [f"{prefix}/{count[0]}/{r}" for r in range(world)]
    count[0] += 1
    store.set(f"{prefix}/latest/{rank}", key)
    store.set(names[rank], key)
    try:
        store.wait(names, timedelta(seconds=AGREEMENT_TIMEOUT_S))
    except Exception:  # the store's timeout (its error type differs between stores)
        missing = [r for r in range(world) if not store.check([names[r]])]
        if missing:
            last = {r: (store.get(f"{prefix}/latest/{r}").decode() if store.check([f"{prefix}/latest/{r}"])
                        else "none yet") for r in missing}
            raise RuntimeError(
                f"te_fuser: rank {rank} trains under {key}, but after {AGREEMENT_TIMEOUT_S:g} s ranks {missing} "
                f"had not switched to a new recipe (the recipes they last trained under: {last}). Give every "
                f"rank the same recipe at the same step") from None
    keys = [store.get(name).decode() for name in names]
    if any(k != key for k in keys):
        raise different_recipes(keys, "when each first trained under it", rank, key)
    agreed.add(recipe_key)


def different_recipes(values: list, compared: str, rank: int, mine) -> RuntimeError:
    """The error of ranks found training under different recipes: ``values`` (a
    recipe key or digest per rank, in rank order) grouped into sets of ranks, how
    they were ``compared``, and this rank's own recipe ``mine``."""
    ranks_by_value: dict = {}
    for r, v in enumerate(values):
        ranks_by_value.setdefault(v, []).append(r)
    groups = " and ".join(f"ranks {ranks}" for ranks in ranks_by_value.values())
    return RuntimeError(
        f"te_fuser: the ranks train under different recipes ({groups} hold different ones, compared {compared}); "
        f"this rank ({rank}) trains under {mine}. Give every rank the same recipe at the same step")


def casts_beside_collectives(device) -> None:
    """Under an NCCL process group, the CUDA casts take their separate launches.

    The transposing cast's single launch is cooperative: it starts only once every
    block of its grid fits on the GPU at the same time. An NCCL kernel on a
    communication stream holds its multiprocessors until the peer ranks join it,
    and the peers' joining may wait on work that this rank queued behind the cast
    (FSDP2's all-gathers and reduce-scatters run beside the compute), which would
    then wait forever. The separate launches (the same bits) start on whatever is
    free. Called when a plan is built, never on the hot path."""
    if getattr(device, "type", None) != "cuda" or not torch.distributed.is_available() \
            or not torch.distributed.is_initialized():
        return
    from .kernels.cuda import one_launch_casts, set_one_launch_casts

    if one_launch_casts() and "nccl" in str(torch.distributed.get_backend()).lower():
        set_one_launch_casts(False)
