"""High-precision flash attention on cuDNN, through torch's SDPA operators.

``attention_forward`` and ``attention_backward`` with the references' signatures
and results: the forward returns o (B, H, T, D) and the natural log-sum-exp lse
(B, H, T) in fp32; the backward takes them (or an FP8 forward's, which
use the same convention) and returns dq, dk, dv. cuDNN's fused attention is
faster than our Triton kernels on Hopper at the shapes a transformer runs
(``benchmarks/RESULTS.md``), so the auto table sends the bf16 and fp16 forward
here; the FP8 forward is our own Hopper kernel (below).

The backward is deterministic by default: our Hopper backward
(:func:`attention_backward_hopper`, dq added in a fixed order, or Triton's dq
kernel and our dk / dv kernel) where it was measured faster than the Triton
kernels, the Triton kernels (which sum in registers) for the rest
(:func:`hopper_backward_form`); all give the same bits
on every run, so a recipe switch stays bit-identical to a fresh model, and the
auto table sends the backward here. cuDNN's backward is faster still but adds dq
across key tiles with atomics, so two runs of one step may differ in the last
bits: ``set_backward_kernel("cudnn")`` chooses it for a process, except under
``torch.use_deterministic_algorithms(True)``.

Layouts. q, k, v are the op's views of the fused QKV tensor (B, T, H + 2·Hkv, D);
cuDNN writes o in q's stride order, so o's (B, T, H·D) merge is a view. Its
gradients come back dense (B, heads, T, D); one Triton launch copies them into
one (B, T, H + 2·Hkv, D) buffer, the fused input's gradient, which the op then
takes without a concatenation (:func:`merge_head_gradients`).

What cuDNN does not take goes to the Triton kernels per call
(:func:`attention_forward_unsupported_reason`): dtypes other than bf16 and fp16,
a GPU before sm_80, a torch without cuDNN attention, and causal attention with
Tq != Tk (both libraries align the mask top-left, but only Tq == Tk is tested
here on the GPU).

The FP8 forward (:func:`attention_forward_fp8`) is our own kernel
(``attention_kernels.cu``): Hopper's FP8 tensor cores through wgmma, a producer
warpgroup staging K and V and two consumer warpgroups running the online softmax,
with the Triton FP8 forward's meaning. Its default schedule keeps each consumer's
next S = Q Kᵀ and last P·V in flight during its softmax, P·V adding into O in the
tensor cores' accumulator: other bits than Triton's (which adds each key tile's
product in fp32), within the same FP8 bound of exact attention, the same on every
run. On the H200 it is 1.36x Triton's FP8 forward at B 4, 16 heads, T 4096, head
dim 128, 1.08x with grouped kv heads and 1.13x at the GPT's shape, 0.98x at head
dim 64 with T 4096 (RESULTS.md run 186), so the auto table sends the FP8 forward
here; head dims other than 64 and 128, GPUs before sm_90 and layouts its 16-byte
copies cannot read go to Triton per call
(:func:`attention_forward_fp8_unsupported_reason`). ``set_hopper_schedule(overlap=False)``
gives the in-order schedule (each tile's P·V a fresh product added in fp32, Triton's
numerics; 0.99x cuDNN's bf16 forward at the main case against the overlapped 1.10x).

:func:`attention_forward_hopper` is the same block for bf16 and fp16
(``attention_hp_kernels.cu``): one C++ call a forward where cuDNN's through torch's
SDPA operator costs several times the host time, with the Triton forward's
rounding. It too waits for the GPU before it joins the backend; until then
:func:`set_forward_kernel` makes this backend's forward run it in a process (what
``benchmarks/auto_entry_ab.py --cuda-forward`` measures on the GPT's step).
"""

from __future__ import annotations

import functools

import torch

from ..reference.attention import check_attention, check_attention_backward, check_attention_fp8, keys_inner

__all__ = ["attention_forward", "attention_backward", "attention_forward_unsupported_reason",
           "attention_backward_unsupported_reason", "attention_forward_fp8", "attention_forward_fp8_unsupported_reason",
           "set_hopper_schedule", "set_hopper_backward_stages", "BY_SHAPE", "attention_forward_hopper",
           "attention_forward_hopper_unsupported_reason",
           "set_forward_kernel", "FORWARD_KERNELS", "attention_dkdv_hopper",
           "attention_backward_hopper", "set_backward_kernel", "BACKWARD_KERNELS", "hopper_backward_form"]

_DTYPES = (torch.bfloat16, torch.float16)
_no_rng: dict = {}  # device -> the (seed, offset) pair cuDNN's backward takes; unused without dropout


@functools.lru_cache(maxsize=None)
def _device_reason(device: torch.device) -> str | None:
    """What the device or the build lacks (asked once per device)."""
    if device.type != "cuda":
        return f"cuDNN attention needs CUDA tensors, got {device.type}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "cuDNN fused attention needs sm_80 or later"
    if not torch.backends.cudnn.is_available() or torch.backends.cudnn.version() < 90000:
        return "cuDNN attention needs cuDNN 9 or later"
    return None


def _unsupported(q, k) -> str | None:
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return None  # the check names the argument
    if q.dtype not in _DTYPES:
        return f"cuDNN attention takes bf16 and fp16, got {q.dtype}"
    reason = _device_reason(q.device)
    if reason is None and q.dim() == 4 and k.dim() == 4 and q.shape[2] != k.shape[2]:
        return "queries and keys of different lengths go to the triton kernels"
    return reason


def attention_forward_unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why :func:`attention_forward` would not run these operands (None: it runs)."""
    return _unsupported(q, k)


def attention_backward_unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    if _backward_kernel["name"] == "cudnn" and torch.are_deterministic_algorithms_enabled():
        return "cuDNN's attention backward is not deterministic (torch.use_deterministic_algorithms is on)"
    return _unsupported(q, k)


def _require(reason: str | None, kernel: str) -> None:
    if reason is not None:
        raise ValueError(f"{kernel}: {reason}")


def attention_forward(q, k, v, causal, softmax_scale):
    """``(o, lse)`` as :func:`attention_forward_reference`, on cuDNN (or on our Hopper
    kernel, see :func:`set_forward_kernel`)."""
    check_attention(q, k, v, causal, softmax_scale)
    _require(attention_forward_unsupported_reason(q, k), "attention_forward")
    return _chosen_forward(q, k, v, causal, softmax_scale)


def _forward_supported(q, k, v, causal, softmax_scale):
    """:func:`attention_forward` for operands whose reason ``te_fuser.backend`` has
    already asked: the argument checks without a second one."""
    check_attention(q, k, v, causal, softmax_scale)
    return _chosen_forward(q, k, v, causal, softmax_scale)


FORWARD_KERNELS = ("cudnn", "hopper")
_forward_kernel = {"name": "cudnn"}


def set_forward_kernel(name: str) -> str:
    """Which kernel this backend's bf16 / fp16 attention forward runs in this process:
    ``"cudnn"`` (the default) or ``"hopper"`` (:func:`attention_forward_hopper`, for
    the operands its extension entry takes, cuDNN's for the rest), the choice to
    measure on the GPU before either becomes the default. Returns the previous one."""
    if name not in FORWARD_KERNELS:
        raise ValueError(f"set_forward_kernel: name must be one of {list(FORWARD_KERNELS)}, got {name!r}")
    previous = _forward_kernel["name"]
    _forward_kernel["name"] = name
    return previous


def _chosen_forward(q, k, v, causal, softmax_scale):
    if _forward_kernel["name"] == "hopper":  # the extension checks the operands: None for what it does not take
        from ._build import extension, stream_of_index
        from .cast import current_device_index

        index = current_device_index()
        out = extension().attention_hp_forward_lean(q, k, v, float(softmax_scale), bool(causal), index,
                                                     stream_of_index(index))
        if out is not None:
            return out
    return _cudnn_forward(q, k, v, causal, softmax_scale)


def _cudnn_forward(q, k, v, causal, softmax_scale):
    B, H, Tq = q.shape[:3]
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                             scale=float(softmax_scale))
    return out[0], out[1].reshape(B, H, Tq)


attention_forward.when_supported = _forward_supported


def _rng_placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pair = _no_rng.get(device)
    if pair is None:
        pair = _no_rng[device] = (torch.zeros((), dtype=torch.int64, device=device),
                                  torch.zeros((), dtype=torch.int64, device=device))
    return pair


def _in_layout_of(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (q's shape) stored densely in q's stride order, the layout cuDNN's forward
    gives o: a copy only when ``t`` is stored otherwise."""
    order = sorted(range(4), key=lambda d: -q.stride(d))
    dense = [0] * 4
    step = 1
    for d in reversed(order):
        dense[d] = step
        step *= q.shape[d]
    if list(t.stride()) == dense or t.numel() == 0:
        return t
    out = torch.empty_strided(q.shape, dense, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


BACKWARD_KERNELS = ("fastest", "hopper", "cudnn")
_backward_kernel = {"name": "fastest"}


def set_backward_kernel(name: str) -> str:
    """Which kernels this backend's bf16 / fp16 attention backward runs in this process:
    ``"fastest"`` (the default: one of our Hopper backwards where
    :func:`hopper_backward_form` names it, else the Triton kernels), ``"hopper"``
    (our Hopper backward wherever its extension entry takes the operands, else the
    Triton kernels) or ``"cudnn"`` (cuDNN's, which
    adds with atomics: not the same bits every run). Returns the previous one."""
    if name not in BACKWARD_KERNELS:
        raise ValueError(f"set_backward_kernel: name must be one of {list(BACKWARD_KERNELS)}, got {name!r}")
    previous = _backward_kernel["name"]
    _backward_kernel["name"] = name
    return previous


def hopper_backward_form(q: torch.Tensor, k: torch.Tensor, causal: bool) -> str | None:
    """Which of our Hopper backwards was measured faster than the Triton kernels for
    this shape (RESULTS.md runs 219-224, H100), None for neither. Causal attention
    with Tk · D of 2^18 or more (head dim 128 from 2048 keys, 64 from 4096):
    ``"one kernel"`` (:func:`attention_backward_hopper`, 0.90-0.95x Triton's time)
    with as many kv heads as query heads; ``"dk/dv"`` (Triton's dq kernel, then our
    dk / dv kernel, 0.82x) with grouped kv heads, whose blocks walk G heads' queries
    each, so the one kernel's grid, which must run a kv head's short blocks before
    its long ones for its fixed order of dq's adds, leaves a long tail. Below that a
    block's fixed costs (its K and V, the turns it waits for) weigh on too few steps
    (1.02-1.16x at 1024 and 2048 keys); without the mask a kv head's blocks add to
    each chunk of dq one after another (1.01-1.27x)."""
    if not causal or k.shape[2] * q.shape[3] < 1 << 18:
        return None
    return "one kernel" if q.shape[1] == k.shape[1] else "dk/dv"


def attention_backward(q, k, v, o, lse, do, causal, softmax_scale):
    """``(dq, dk, dv)`` as :func:`attention_backward_reference`, on our Hopper kernels or
    the Triton kernels (or cuDNN: :func:`set_backward_kernel`): views of one (B, T, H +
    2·Hkv, D) buffer.

    o and do are handed to cuDNN in q's stride order (copied when they are stored
    otherwise, e.g. an FP8 forward's o beside dequantized, contiguous q, k, v):
    torch keeps one cuDNN plan per q, k, v layout, and a plan built for one o
    layout reads another o wrongly (measured: dq of a one-key row, which is 0,
    came out 2.3)."""
    check_attention_backward(q, k, v, o, lse, do, causal, softmax_scale)
    _require(attention_backward_unsupported_reason(q, k), "attention_backward")
    return _chosen_backward(q, k, v, o, lse, do, causal, softmax_scale)


def _backward_supported(q, k, v, o, lse, do, causal, softmax_scale):
    """:func:`attention_backward` without the second look at its reason (see
    :func:`_forward_supported`)."""
    check_attention_backward(q, k, v, o, lse, do, causal, softmax_scale)
    return _chosen_backward(q, k, v, o, lse, do, causal, softmax_scale)


def _chosen_backward(q, k, v, o, lse, do, causal, softmax_scale):
    name = _backward_kernel["name"]
    if name == "cudnn":
        return _cudnn_backward(q, k, v, o, lse, do, causal, softmax_scale)
    from ..triton import attention as triton_attention  # here: importing this backend loads no triton

    form = "one kernel" if name == "hopper" else hopper_backward_form(q, k, causal)
    if form is not None and _extension_runs(q.device):
        from ._build import extension, stream_of_index
        from .cast import current_device_index

        index, lse = current_device_index(), lse.float().contiguous()
        if form == "one kernel":  # the extension checks the operands: None for what it does not take
            out = extension().attention_hp_backward(q, k, v, o, lse, do, float(softmax_scale), bool(causal),
                                                    _in_kernel_stages(q, k), index, stream_of_index(index))
            if out is not None:
                return out
        elif _hopper_backward_reason(q, k, v, do) is None:
            dq, dk, dv, delta = triton_attention.attention_dq_with_buffers(q, k, v, o, lse, do, causal, softmax_scale)
            if extension().attention_hp_dkdv(q, k, v, do, lse, delta, float(softmax_scale), bool(causal), dk, dv,
                                             index, stream_of_index(index)) is not None:
                return dq, dk, dv
            # the extension checks what the reason above checks, so this is not expected: the whole
            # backward again on Triton's kernels rather than a second path for dk and dv alone
    return triton_attention.attention_backward_prechecked(q, k, v, o, lse, do, causal, softmax_scale)


def _extension_runs(device: torch.device) -> bool:
    from ._build import unavailable_reason

    return unavailable_reason(device) is None


def _cudnn_backward(q, k, v, o, lse, do, causal, softmax_scale):
    o, do = _in_layout_of(q, o), _in_layout_of(q, do)
    seed, offset = _rng_placeholders(q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse.unsqueeze(-1), seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal,
        scale=float(softmax_scale))
    from ..triton.attention import merge_head_gradients  # here: importing this backend loads no triton

    return merge_head_gradients(dq, dk, dv)


attention_backward.when_supported = _backward_supported


# ------------------------------------------------- the Hopper kernels' forwards

_HOPPER_HEAD_DIMS = (64, 128)  # the Hopper kernels' head dims


def _hopper_layout_reason(t: torch.Tensor, name: str, kernel: str) -> str | None:
    """Why a Hopper kernel's 16-byte copies cannot read ``t`` as it is stored."""
    if t.dim() != 4 or t.shape[-1] not in _HOPPER_HEAD_DIMS:
        return f"{kernel} takes head dims {_HOPPER_HEAD_DIMS}, got {name} of shape {tuple(t.shape)}"
    per_chunk = 16 // t.element_size()
    if t.stride(-1) != 1 or any(s % per_chunk for s in t.stride()[:3]) or t.data_ptr() % 16:
        return (f"{kernel} reads rows of 16-byte aligned chunks; {name} has strides {tuple(t.stride())} at offset "
                f"{t.data_ptr() % 16} of 16")
    return None


def _hopper_reason(q: torch.Tensor, k: torch.Tensor, dtypes: tuple, kernel: str) -> str | None:
    """Why a Hopper kernel (``kernel``, inputs of ``dtypes``) would not run q and k
    (None: it runs)."""
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return None  # the check names the argument
    if q.dtype not in dtypes:
        return f"{kernel} takes {' and '.join(str(d).replace('torch.', '') for d in dtypes)}, got {q.dtype}"
    if q.device.type != "cuda":
        return f"{kernel} needs CUDA tensors, got a {q.device.type} tensor"
    from ._build import unavailable_reason

    reason = unavailable_reason(q.device)
    if reason is not None:
        return reason
    for t, name in ((q, "q"), (k, "k")):
        reason = _hopper_layout_reason(t, name, kernel)
        if reason is not None:
            return reason
    if q.dim() == 4 and q.shape[0] * q.shape[1] > 65535:
        return f"{kernel}'s grid holds 65535 batch·heads, got {q.shape[0] * q.shape[1]}"
    return None


_FP8_KERNEL = "the cuda FP8 attention kernel"
_HOPPER_KERNEL = "the cuda Hopper attention kernel"


def _tensor_map_reason(t: torch.Tensor, name: str, kernel: str = _FP8_KERNEL) -> str | None:
    """Why a Hopper kernel's tensor maps do not describe ``t``: a broadcast dim (stride
    0 over more than one element), which its tensor copies are not made for."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        return None  # another check names it
    if any(size > 1 and stride == 0 for size, stride in zip(t.shape[:3], t.stride()[:3])):
        return (f"{kernel} copies {name} through tensor maps of its strides, none of them 0 on a dim of "
                f"more than one element; {name} has shape {tuple(t.shape)} and strides {tuple(t.stride())}")
    return None


def attention_forward_fp8_unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why :func:`attention_forward_fp8` would not run these operands (None: it runs)."""
    return (_hopper_reason(q, k, (torch.float8_e4m3fn,), _FP8_KERNEL) or _tensor_map_reason(q, "q")
            or _tensor_map_reason(k, "k"))


def attention_forward_fp8(q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, p_scale, causal, softmax_scale,
                          out_dtype):
    """FP8 flash attention forward on Hopper's tensor cores: ``(o, lse)`` as
    :func:`attention_forward_fp8_reference` (up to where the running maximum puts
    each probability on the E4M3 grid, as the Triton kernel, and, in the default
    schedule, the tensor cores' accumulation of P·V; see the reference)."""
    check_attention_fp8(q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, p_scale, causal, softmax_scale, out_dtype)
    _require(attention_forward_fp8_unsupported_reason(q, k), "attention_forward_fp8")
    return _fp8_forward(q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, p_scale, causal, softmax_scale, out_dtype)


def _fp8_forward_supported(q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, p_scale, causal, softmax_scale,
                           out_dtype):
    """:func:`attention_forward_fp8` for q and k whose reason ``te_fuser.backend``
    has already asked: the argument checks without a second one."""
    check_attention_fp8(q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, p_scale, causal, softmax_scale, out_dtype)
    return _fp8_forward(q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, p_scale, causal, softmax_scale, out_dtype)


def keys_inner_reason(k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the FP8 forward would not read a keys-inner ``v`` as it lies (None: it
    does, reading K's rows permuted instead of rewriting V; else it takes V as a
    contiguous copy): Tk a multiple of 16, v's other strides and its start multiples
    of 16 bytes, and k's batches after its heads or after its keys in memory (the
    copy of K permuted has no dimension left for them)."""
    if v.shape[2] % 16:
        return f"Tk {v.shape[2]} is not a multiple of 16"
    if any(v.stride(d) <= 0 or v.stride(d) % 16 for d in (0, 1, 3)) or v.data_ptr() % 16:
        return f"v's strides {tuple(v.stride())} at offset {v.data_ptr() % 16} are not of 16-byte multiples"
    if not (k.shape[0] == 1 or k.stride(0) in (k.shape[1] * k.stride(1), k.shape[2] * k.stride(2))):
        return f"k's batch stride {k.stride(0)} is neither its heads' nor its keys' end (strides {tuple(k.stride())})"
    return None


def _fp8_forward(q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, p_scale, causal, softmax_scale, out_dtype):
    """The kernel on checked arguments whose q and k it takes (v's layout asked here:
    one with its keys inner read as it lies where :func:`keys_inner_reason` allows,
    else copied to the layout the kernel rewrites)."""
    scales = torch.stack([s.reshape(()) for s in (q_scale_inv, k_scale_inv, v_scale_inv, p_scale)])
    if keys_inner(v):
        if keys_inner_reason(k, v) is None:
            return _run_checked("attention_forward_fp8", "attention_fp8_forward_lean", None, q, k, v, scales,
                                float(softmax_scale), bool(causal), out_dtype)
        v = v.contiguous()
    reason = _hopper_layout_reason(v, "v", _FP8_KERNEL)
    return _run_checked("attention_forward_fp8", "attention_fp8_forward_lean", reason, q, k, v, scales,
                        float(softmax_scale), bool(causal), out_dtype)


attention_forward_fp8.when_supported = _fp8_forward_supported


def _run_checked(kernel: str, entry: str, reason: str | None, q, k, v, *args):
    """The extension's ``entry(q, k, v, *args, device, stream)`` on q's device, for
    ``kernel``'s operands whose checks passed (``reason`` None, else raised)."""
    if reason is not None:
        raise ValueError(f"{kernel}: {reason}")
    from ._build import extension, stream_of_index
    from .cast import current_device_index, on_device

    with on_device(q.device):
        index = current_device_index()
        out = getattr(extension(), entry)(q, k, v, *args, index, stream_of_index(index))
    if out is None:  # every operand checked
        raise ValueError(f"{kernel}: the extension did not take q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    return out


BY_SHAPE = "by shape"  # a setting of the Hopper kernels chosen by the operands' shape (set_hopper_*)
_backward_stages = {"dq_in_kernel": BY_SHAPE, "delta_in_kernel": False}


def set_hopper_backward_stages(dq_in_kernel: bool | str | None = None,
                               delta_in_kernel: bool | str | None = None) -> tuple:
    """What the one-kernel Hopper backward's dk / dv kernel (:func:`attention_backward_hopper`,
    causal only) also does, for this process: True, False or :data:`BY_SHAPE` each;
    None leaves a setting. ``dq_in_kernel``: once every block of the grid has
    started, a finished block's consumers store dq's chunks in the input type as
    their last adds land (key block 0, every chunk's last adder, queues each one;
    the claimers take them by one fetch-and-add each), so no kernel follows it.
    ``delta_in_kernel`` (as many kv heads as query heads, Tq <= Tk): key block n
    makes delta = rowsum(o ∘ do) of query chunks 2n and 2n + 1, which it reads
    first, while its first copies land, and flags them for the blocks after it, so
    the kernel before it reads lse alone. The same bits as without, either way.
    By default dq is stored in the kernel by shape (:func:`_in_kernel_stages`) and
    delta is not made there (RESULTS.md runs 232-237, H100: 0.2-6.8% slower at
    every shape timed). Returns the previous pair."""
    given = {"dq_in_kernel": dq_in_kernel, "delta_in_kernel": delta_in_kernel}
    for name, value in given.items():
        if value is not None and not isinstance(value, bool) and not (isinstance(value, str) and value == BY_SHAPE):
            raise ValueError(f"set_hopper_backward_stages: {name} must be True, False, {BY_SHAPE!r} or None, "
                             f"got {value!r}")
    previous = (_backward_stages["dq_in_kernel"], _backward_stages["delta_in_kernel"])
    _backward_stages.update({name: value for name, value in given.items() if value is not None})
    return previous


def _in_kernel_stages(q: torch.Tensor, k: torch.Tensor) -> int:
    """The extension's bits for what the dk / dv kernel also does for these operands
    (1: dq stored, 2: delta made). By shape, dq is stored in the kernel at head dim
    128 up to 8192 keys, where it was measured faster than its own kernel after
    (RESULTS.md runs 233 and 236, H100, rounds in turns: 0.965-0.990x at 4x16x4096,
    8x16x2048 and 2x16x8192), and not at head dim 64 (1.004-1.035x at 4096 and 8192
    keys) or at 16384 keys (1.002x); delta, never."""
    dq = _backward_stages["dq_in_kernel"]
    if dq == BY_SHAPE:
        dq = q.shape[3] == 128 and k.shape[2] <= 8192
    return (1 if dq else 0) | (2 if _backward_stages["delta_in_kernel"] is True else 0)


def set_hopper_schedule(turns: bool | None = None, overlap: bool | None = None,
                        v_in_kernel: bool | str | None = None,
                        mirrored: bool | None = None) -> tuple[bool, bool, bool | str, bool]:
    """The schedule of the Hopper attention kernels (:func:`attention_forward_fp8`,
    :func:`attention_forward_hopper`), for this process (it builds the extension if
    need be); None leaves a setting. ``turns`` (default on): the two consumer
    warpgroups take turns issuing S = Q Kᵀ, so one's softmax runs beside the other's
    product; the same bits either way. ``overlap`` (default on; the FP8 kernel
    only): each also keeps the next tile's S = Q Kᵀ and the last tile's P V in
    flight during its softmax, P V adding into O in the tensor cores' accumulator
    (other bits, within the same bound); off, each tile's P V is a fresh product
    added in fp32, as Triton's kernel adds it. ``v_in_kernel`` (the FP8 kernel
    only; default :data:`BY_SHAPE`: up to 2048 keys): the producer
    warpgroup rewrites each V tile with its keys inner in shared memory, rather than
    a launch before the forward rewriting all of V into a buffer the tiles are
    copied from; the same bits. The kernel rewrites a tile for each query block
    that reads it, the launch once: the kernel's is the faster on short sequences
    only. ``mirrored`` (default on; both forwards): the persistent blocks take the
    items (longest first under the causal mask) in rounds dealt forwards and
    backwards in turn, so that they end together; off, forwards every round (the
    first blocks then take the longest item of each). The same bits either way.
    Returns the previous ``(turns, overlap, v_in_kernel, mirrored)``."""
    from ._build import extension

    if v_in_kernel is not None and not isinstance(v_in_kernel, bool) and v_in_kernel != BY_SHAPE:
        raise ValueError(f"set_hopper_schedule: v_in_kernel is True, False, BY_SHAPE or None, not {v_in_kernel!r}")
    v_code = 2 if v_in_kernel == BY_SHAPE else _setting(v_in_kernel)
    turns, overlap, v_code, mirrored = extension().attention_schedule(_setting(turns), _setting(overlap), v_code,
                                                                      _setting(mirrored))
    return turns, overlap, BY_SHAPE if v_code == 2 else bool(v_code), mirrored


def _setting(value: bool | None) -> int:
    """A process setting as the extension takes it: 0 or 1, -1 to leave it."""
    return -1 if value is None else int(bool(value))


# --------------------------------------------------- bf16 / fp16 forward, Hopper


def attention_forward_hopper_unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why :func:`attention_forward_hopper` would not run these operands (None: it runs)."""
    return _hopper_reason(q, k, _DTYPES, _HOPPER_KERNEL)


def attention_dkdv_hopper(q, k, v, o, lse, do, causal, softmax_scale, delta=None):
    """``(dk, dv)`` of :func:`attention_backward_reference`, bf16 or fp16, on Hopper's
    tensor cores in our kernel (``attention_hp_kernels.cu``): each block keeps the dk
    and dv of 128 keys in registers over every query that reads them, so the same
    bits come every run (no atomics); P and dS rounded to the input type for their
    products, as the Triton dk / dv kernel does. ``delta = rowsum(o · do)`` fp32 (B,
    H, Tq), as Triton's dq kernel stores it (``attention_dq``); made here if None."""
    check_attention_backward(q, k, v, o, lse, do, causal, softmax_scale)
    reason = _hopper_backward_reason(q, k, v, do)
    if delta is None:
        delta = (o.float() * do.float()).sum(-1)
    return _run_checked("attention_dkdv_hopper", "attention_hp_dkdv", reason, q, k, v, do, lse.float().contiguous(),
                        delta.contiguous(), float(softmax_scale), bool(causal), None, None)


def attention_backward_hopper(q, k, v, o, lse, do, causal, softmax_scale):
    """``(dq, dk, dv)`` of :func:`attention_backward_reference`, bf16 or fp16, on
    Hopper's tensor cores in our kernel (``attention_hp_kernels.cu``): blocks of 128
    keys keep their dk and dv in registers over every query that reads them (as
    :func:`attention_dkdv_hopper`'s kernel) and add their share of dq to fp32 chunks
    of 64 queries in a fixed order (the later key blocks first); ``delta = rowsum(o
    · do)`` before, dq from its chunks after. The same bits every run. P and dS are
    rounded to the input type for their products, as Triton's backward does."""
    check_attention_backward(q, k, v, o, lse, do, causal, softmax_scale)
    reason = _hopper_backward_reason(q, k, v, do, o)
    return _run_checked("attention_backward_hopper", "attention_hp_backward", reason, q, k, v, o,
                        lse.float().contiguous(), do, float(softmax_scale), bool(causal), _in_kernel_stages(q, k))


def _hopper_backward_reason(q, k, v, do, o=None) -> str | None:
    """Why the Hopper backward kernels would not read these operands (None: they do)."""
    reason = attention_forward_hopper_unsupported_reason(q, k)
    for t, name in ((v, "v"), (do, "do"), (o, "o")):
        if t is not None:
            reason = reason or _hopper_layout_reason(t, name, _HOPPER_KERNEL)
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (do, "do")):
        reason = reason or _tensor_map_reason(t, name, _HOPPER_KERNEL)
    return reason


def attention_forward_hopper(q, k, v, causal, softmax_scale):
    """Flash attention forward, bf16 or fp16, on Hopper's tensor cores in our kernel
    (``attention_hp_kernels.cu``): ``(o, lse)`` as :func:`attention_forward_reference`,
    with the Triton forward's rounding."""
    check_attention(q, k, v, causal, softmax_scale)
    reason = attention_forward_hopper_unsupported_reason(q, k) or _hopper_layout_reason(v, "v", _HOPPER_KERNEL)
    return _run_checked("attention_forward_hopper", "attention_hp_forward_lean", reason, q, k, v,
                        float(softmax_scale), bool(causal))
