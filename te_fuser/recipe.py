"""FP8 recipes: immutable values whose string is the fusion cache key.

``str(recipe)`` names the class by its stable qualified name and lists every field
that can change quantization, a GEMM or a fusion decision, in resolved form, with
the values derived from them. Equal configurations give byte-identical strings in
any process; the string is computed once, at construction.

Recipes cannot be changed: ``recipe.replace(field=value)`` returns a new one.
Invalid values raise ``ValueError`` naming the field, at construction.

Per-tensor and per-row recipes (``DelayedScaling``, ``Float8CurrentScaling``,
``Float8RowwiseScaling``) choose the accumulation of each FP8 GEMM of a linear layer: ``fprop_fast_accum``,
``dgrad_fast_accum``, ``wgrad_fast_accum``. Hopper's FP8 tensor cores add products
in a narrower-than-fp32 format; by default the partial sums are promoted to the
fp32 accumulator every 128 products. Fast accumulation promotes only at the end,
which is faster and less precise: on zero-mean operands the error stays near 1e-3
of the largest output at K=4096, but the narrow accumulator truncates, so long
sums of same-sign products come out low (8% at K=4096 on an H200). As in common
FP8 training practice the default is fast for fprop and exact for the two
backward GEMMs (whose sums are longer and whose gradients are smaller). The
reference backend always accumulates exactly.

Every recipe has ``backward_override``:

- ``None``: the backward GEMMs run in FP8 like the forward ones;
- ``"high_precision"``: the backward GEMMs use the high-precision tensors saved by
  the forward;
- ``"dequantized"``: the backward GEMMs use the forward's FP8 tensors, dequantized,
  with high-precision gradients.

and the two attention fields of TransformerEngine's recipes (``te.ops.DotProductAttention``):

- ``fp8_dpa``: the attention core runs in FP8: it casts its Q, K, V input (one
  per-tensor scale, the ``dpa.qkv`` role), quantizes the probabilities P (``dpa.s``)
  and its output O (``dpa.o``), and hands O on dequantized; its backward reads the
  output gradient on the ``dpa.do`` grid. Off (the default), attention runs in high
  precision under any recipe, and the recipe prescribes identity quantizers for
  attention's roles (:meth:`Recipe.quantizes`);
- ``fp8_mha``: also removes the casts at attention's boundaries: the QKV
  projection hands attention its FP8 Q, K, V, and attention hands its FP8 O to the
  output projection (the fusion rules of ``ops/fused/forward_linear_bias_dpa_linear.py``
  and ``ops/fused/forward_dpa_linear.py``). It implies FP8 attention, as in TE.

FP8 attention needs per-tensor scales (the kernel takes one scale per tensor):
under the per-row, block and MXFP8 recipes a plan with attention and ``fp8_dpa`` or
``fp8_mha`` is refused at build time with an error naming the op and the field.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import torch

from .kernels import env as _env
from .callable_key import callable_key, keyed
from .fp8 import E4M3, E5M2, FP8_MAX, short_name
from .quantization.role import ATTENTION_MODULE_TYPE

__all__ = [
    "Format",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8RowwiseScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "CustomRecipe",
    "keyed",
    "BACKWARD_OVERRIDES",
    "FAST_ACCUM_GEMMS",
]

BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
FAST_ACCUM_GEMMS = ("fprop", "dgrad", "wgrad")


class Format(enum.Enum):
    """FP8 formats of the forward and backward passes."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"  # E4M3 forward, E5M2 backward

    @property
    def fwd_dtype(self) -> torch.dtype:
        return E5M2 if self is Format.E5M2 else E4M3

    @property
    def bwd_dtype(self) -> torch.dtype:
        return E4M3 if self is Format.E4M3 else E5M2

    def __str__(self) -> str:
        return self.value


def _canon(value: Any) -> str:
    """Canonical text of one field value."""
    if value is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return repr(value + 0.0)  # -0.0 + 0.0 == 0.0; repr is shortest round-trip
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, torch.dtype):
        return short_name(value)
    if isinstance(value, tuple):
        return "(" + ",".join(_canon(v) for v in value) + ")"
    raise TypeError(f"no canonical form for {type(value).__name__}")


class Recipe:
    """Base of all recipes: immutability, the key string, ``replace``, equality."""

    _callable_fields: ClassVar[dict[str, str]] = {}  # callable field -> its *_key field

    def __post_init__(self) -> None:
        self._resolve()
        self._validate_common()
        self._validate()
        key = self._build_key()
        object.__setattr__(self, "key", key)  # the fusion key: str(recipe), computed once
        object.__setattr__(self, "_sealed", True)

    # -- immutability ------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_sealed", False):
            raise TypeError(
                f"{type(self).__name__} is immutable: cannot set {name!r}. "
                f"Use recipe.replace({name}=...) to get a changed copy."
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise TypeError(
            f"{type(self).__name__} is immutable: cannot delete {name!r}. "
            "Use recipe.replace(...) to get a changed copy."
        )

    def replace(self, **changes: Any) -> "Recipe":
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.replace(): unknown field(s) {unknown}; fields are {sorted(names)}"
            )
        return dataclasses.replace(self, **changes)

    # -- the key -----------------------------------------------------------
    def __str__(self) -> str:
        return self.key

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    @classmethod
    def qualified_name(cls) -> str:
        return f"te_fuser.recipe.{cls.__qualname__}"

    def _key_items(self) -> Iterator[tuple[str, str]]:
        key_fields = set(self._callable_fields.values())
        for f in dataclasses.fields(self):
            if f.name in key_fields:
                continue  # folded into the callable it names
            value = getattr(self, f.name)
            if f.name in self._callable_fields and callable(value):
                yield f.name, callable_key(value, getattr(self, self._callable_fields[f.name]))
            else:
                yield f.name, _canon(value)
        for name, value in self.derived().items():
            yield name, _canon(value)

    def _build_key(self) -> str:
        body = ", ".join(f"{k}={v}" for k, v in self._key_items())
        return f"{self.qualified_name()}({body})"

    def derived(self) -> dict[str, Any]:
        """Values resolved from the fields that the kernels depend on."""
        return {}

    # -- validation --------------------------------------------------------
    def _fail(self, name: str, constraint: str) -> None:
        value = getattr(self, name, "<unset>")
        raise ValueError(f"{type(self).__name__}.{name}: {constraint}, got {value!r}")

    def _resolve(self) -> None:
        if hasattr(self, "fp8_format") and isinstance(self.fp8_format, str):
            try:
                object.__setattr__(self, "fp8_format", Format[self.fp8_format.upper()])
            except KeyError:
                self._fail("fp8_format", f"must be one of {[f.name for f in Format]}")

    def _validate_common(self) -> None:
        if self.backward_override not in BACKWARD_OVERRIDES:
            self._fail("backward_override", f"must be one of {list(BACKWARD_OVERRIDES)}")
        self._require_bool("fp8_dpa")
        self._require_bool("fp8_mha")
        if hasattr(self, "fp8_format"):
            if not isinstance(self.fp8_format, Format):
                self._fail("fp8_format", "must be a te_fuser.recipe.Format")
            if self.fp8_format is Format.E5M2:
                self._fail("fp8_format", "pure E5M2 training is not supported; use E4M3 or HYBRID")
        for name, key_name in self._callable_fields.items():
            key = getattr(self, key_name)
            if key is not None:
                if not isinstance(key, str) or not key.strip():
                    self._fail(key_name, "must be a non-empty string or None")
                if not callable(getattr(self, name)):
                    self._fail(key_name, f"only applies when {name} is a callable")

    def _validate(self) -> None:
        pass

    # -- attention ---------------------------------------------------------------
    @property
    def fp8_attention(self) -> bool:
        """Whether attention runs in FP8 (``fp8_dpa`` or ``fp8_mha``)."""
        return self.fp8_dpa or self.fp8_mha

    def quantizes(self, role) -> bool:
        """Whether this recipe casts ``role``'s tensor to FP8 (else the role gets an
        identity quantizer): every role but attention's, which only under ``fp8_dpa``
        or ``fp8_mha``."""
        return role.module_type != ATTENTION_MODULE_TYPE or self.fp8_attention

    def _require_bool(self, name: str) -> None:
        if not isinstance(getattr(self, name), bool):
            self._fail(name, "must be True or False")

    def _validate_fast_accum(self) -> None:
        for name in FAST_ACCUM_GEMMS:
            self._require_bool(f"{name}_fast_accum")

    def fast_accum(self, gemm: str) -> bool:
        """Whether ``gemm`` ('fprop', 'dgrad' or 'wgrad') accumulates fast (see the module doc)."""
        return getattr(self, f"{gemm}_fast_accum", False)

    def _require_int(self, name: str, minimum: int) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self._fail(name, f"must be an integer >= {minimum}")

    def _require_epsilon(self, name: str) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self._fail(name, "must be a finite float >= 0")
        value = float(value)
        if not (value >= 0.0 and value != float("inf")):
            self._fail(name, "must be a finite float >= 0")
        object.__setattr__(self, name, value + 0.0)

    # -- quantizers ------------------------------------------------------------
    def make_quantizer(self, role):
        """A fresh quantizer for ``role`` (a ``QuantizerRole``), built from this
        recipe's validated fields: every recipe is its own quantizer factory."""
        raise NotImplementedError(f"{type(self).__name__} does not build quantizers")

    def _fp8_dtype(self, role) -> "torch.dtype":
        """The format's forward dtype for forward roles, its backward one for gradients."""
        return self.fp8_format.bwd_dtype if role.is_backward else self.fp8_format.fwd_dtype

    # -- kinds ---------------------------------------------------------------
    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_rowwise_scaling(self) -> bool:
        return isinstance(self, Float8RowwiseScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def custom(self) -> bool:
        return isinstance(self, CustomRecipe)

    def _fp8_derived(self) -> dict[str, Any]:
        fmt = self.fp8_format
        return {
            "fwd_dtype": fmt.fwd_dtype,
            "bwd_dtype": fmt.bwd_dtype,
            "fwd_max": FP8_MAX[fmt.fwd_dtype],
            "bwd_max": FP8_MAX[fmt.bwd_dtype],
        }


_AMAX_ALGOS = ("max", "most_recent")

# tensor role -> the recipe field that configures it
_EPSILON_FIELD = {"input": "input_amax_epsilon", "output": "input_amax_epsilon", "weight": "weight_amax_epsilon",
                  "grad_output": "grad_amax_epsilon", "grad_input": "grad_amax_epsilon",
                  "qkv": "input_amax_epsilon", "s": "input_amax_epsilon", "o": "input_amax_epsilon",
                  "do": "grad_amax_epsilon"}
_BLOCK_DIM_FIELD = {"input": "x_block_scaling_dim", "output": "x_block_scaling_dim", "weight": "w_block_scaling_dim",
                    "grad_output": "grad_block_scaling_dim", "grad_input": "grad_block_scaling_dim",
                    "qkv": "x_block_scaling_dim", "s": "x_block_scaling_dim", "o": "x_block_scaling_dim",
                    "do": "grad_block_scaling_dim"}


@dataclass(eq=False, repr=False)
class DelayedScaling(Recipe):
    """Per-tensor scales computed from a history of past amaxes.

    ``scale = (fmax / amax_from_history) / 2**margin``. ``amax_compute_algo`` is
    ``"max"``, ``"most_recent"`` or a callable ``f(amax_history) -> amax`` (history
    newest first, shape ``(amax_history_len,)``). ``scaling_factor_compute_algo``,
    when given, replaces the formula: ``f(amax, scale, fmax, recipe) -> new_scale``.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable = "max"
    amax_compute_algo_key: str | None = None
    scaling_factor_compute_algo: Callable | None = None
    scaling_factor_compute_algo_key: str | None = None
    reduce_amax: bool = True
    fprop_fast_accum: bool = field(default=True, kw_only=True)
    dgrad_fast_accum: bool = field(default=False, kw_only=True)
    wgrad_fast_accum: bool = field(default=False, kw_only=True)
    backward_override: str | None = field(default=None, kw_only=True)
    fp8_dpa: bool = field(default=False, kw_only=True)
    fp8_mha: bool = field(default=False, kw_only=True)

    _callable_fields: ClassVar[dict[str, str]] = {
        "amax_compute_algo": "amax_compute_algo_key",
        "scaling_factor_compute_algo": "scaling_factor_compute_algo_key",
    }

    def _validate(self) -> None:
        self._require_int("margin", 0)
        self._require_int("amax_history_len", 1)
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in _AMAX_ALGOS:
            self._fail("amax_compute_algo", f"must be one of {list(_AMAX_ALGOS)} or a callable")
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            self._fail("scaling_factor_compute_algo", "must be a callable or None")
        self._require_bool("reduce_amax")
        self._validate_fast_accum()

    def derived(self) -> dict[str, Any]:
        return {**self._fp8_derived(), "scaling": "tensor"}

    def make_quantizer(self, role):
        from .quantization.delayed import DelayedScalingQuantizer

        return DelayedScalingQuantizer(self._fp8_dtype(role), margin=self.margin,
                                       amax_history_len=self.amax_history_len,
                                       amax_compute_algo=self.amax_compute_algo,
                                       scaling_factor_compute_algo=self.scaling_factor_compute_algo, recipe=self)


@dataclass(eq=False, repr=False)
class _AmaxScaling(Recipe):
    """The fields and quantizers of the recipes whose scales come from the amax of
    the tensor being cast itself (per tensor, per row): ``scale = fmax / max(amax,
    epsilon)``, rounded down to a power of two when ``power_2_scales``. Epsilons
    are per tensor role: input, weight, gradient."""

    fp8_format: Format = Format.HYBRID
    power_2_scales: bool = False
    input_amax_epsilon: float = 0.0
    weight_amax_epsilon: float = 0.0
    grad_amax_epsilon: float = 0.0
    fprop_fast_accum: bool = field(default=True, kw_only=True)
    dgrad_fast_accum: bool = field(default=False, kw_only=True)
    wgrad_fast_accum: bool = field(default=False, kw_only=True)
    backward_override: str | None = field(default=None, kw_only=True)
    fp8_dpa: bool = field(default=False, kw_only=True)
    fp8_mha: bool = field(default=False, kw_only=True)

    _SCALING = ""  # each recipe's scaling scheme, in its key

    def _validate(self) -> None:
        self._require_bool("power_2_scales")
        for name in ("input_amax_epsilon", "weight_amax_epsilon", "grad_amax_epsilon"):
            self._require_epsilon(name)
        self._validate_fast_accum()

    def derived(self) -> dict[str, Any]:
        return {**self._fp8_derived(), "scaling": self._SCALING}

    def make_quantizer(self, role):
        epsilon = getattr(self, _EPSILON_FIELD[role.tensor_type])
        return self._quantizer_class()(self._fp8_dtype(role), self.power_2_scales, epsilon)

    @staticmethod
    def _quantizer_class():
        raise NotImplementedError


@dataclass(eq=False, repr=False)
class Float8CurrentScaling(_AmaxScaling):
    """Per-tensor scales from the amax of the tensor being cast.

    ``scale = fmax / max(amax, epsilon)``, rounded down to a power of two when
    ``power_2_scales``. Epsilons are per tensor role: input, weight, gradient.
    """

    _SCALING = "tensor"

    @staticmethod
    def _quantizer_class():
        from .quantization.current import Float8CurrentScalingQuantizer

        return Float8CurrentScalingQuantizer


@dataclass(eq=False, repr=False)
class Float8RowwiseScaling(_AmaxScaling):
    """Per-row scales from each row's own amax (current scaling, row by row).

    Every GEMM operand is scaled along the rows it reduces over: one fp32 scale
    per token of an activation or gradient and per output (or, for the backward,
    input) channel of a weight, so an outlier only coarsens its own row.
    ``scale = fmax / max(amax(row), epsilon)``, rounded down to a power of two
    when ``power_2_scales`` (the default). Epsilons are per tensor role.
    """

    power_2_scales: bool = True
    _SCALING = "row"

    @staticmethod
    def _quantizer_class():
        from .quantization.rowwise import Float8RowwiseQuantizer

        return Float8RowwiseQuantizer


MXFP8_BLOCK = 32


@dataclass(eq=False, repr=False)
class MXFP8BlockScaling(Recipe):
    """MXFP8: one E8M0 (power-of-two) scale per 32 consecutive elements along the
    reduction dimension; row-wise and column-wise copies are each quantized from the
    high-precision tensor."""

    fp8_format: Format = Format.E4M3
    backward_override: str | None = field(default=None, kw_only=True)
    fp8_dpa: bool = field(default=False, kw_only=True)
    fp8_mha: bool = field(default=False, kw_only=True)

    def derived(self) -> dict[str, Any]:
        return {**self._fp8_derived(), "scaling": "mx", "block": MXFP8_BLOCK, "scale_dtype": "e8m0"}

    def make_quantizer(self, role):
        from .quantization.mxfp8 import MXFP8Quantizer

        return MXFP8Quantizer(self._fp8_dtype(role))


BLOCK_SCALING_TILE = 128


@dataclass(eq=False, repr=False)
class Float8BlockScaling(Recipe):
    """DeepSeek-style block scaling: 1x128 tiles (dim 1) or 128x128 tiles (dim 2).

    Defaults: 1x128 for activations and gradients, 128x128 for weights. A GEMM of
    two 2D-scaled operands is not supported, so any pair of x / w / grad both at 2
    is rejected. ``power_2_scales`` left as ``None`` is resolved at construction
    from ``TE_FUSER_FP8_BLOCK_SCALING_FP32_SCALES`` (unset: power-of-2 scales).
    """

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    power_2_scales: bool | None = None
    input_amax_epsilon: float = 0.0
    weight_amax_epsilon: float = 0.0
    grad_amax_epsilon: float = 0.0
    backward_override: str | None = field(default=None, kw_only=True)
    fp8_dpa: bool = field(default=False, kw_only=True)
    fp8_mha: bool = field(default=False, kw_only=True)

    def _resolve(self) -> None:
        super()._resolve()
        if self.power_2_scales is None:
            object.__setattr__(self, "power_2_scales", _env.block_scaling_power_2_scales_default())

    def _validate(self) -> None:
        dims = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
        for name in dims:
            value = getattr(self, name)
            if isinstance(value, bool) or value not in (1, 2):
                self._fail(name, "must be 1 (1x128 tiles) or 2 (128x128 tiles)")
        for a, b in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if getattr(self, f"{a}_block_scaling_dim") == 2 and getattr(self, f"{b}_block_scaling_dim") == 2:
                self._fail(
                    f"{b}_block_scaling_dim",
                    f"{a} and {b} share a GEMM and cannot both use 128x128 tiles (2D by 2D is not supported)",
                )
        self._require_bool("power_2_scales")
        for name in ("input_amax_epsilon", "weight_amax_epsilon", "grad_amax_epsilon"):
            self._require_epsilon(name)

    def derived(self) -> dict[str, Any]:
        return {**self._fp8_derived(), "scaling": "block", "tile": BLOCK_SCALING_TILE}

    def make_quantizer(self, role):
        from .quantization.block import Float8BlockQuantizer

        block_dim = getattr(self, _BLOCK_DIM_FIELD[role.tensor_type])
        epsilon = getattr(self, _EPSILON_FIELD[role.tensor_type])
        return Float8BlockQuantizer(self._fp8_dtype(role), block_dim, self.power_2_scales, epsilon)


@dataclass(eq=False, repr=False)
class CustomRecipe(Recipe):
    """A recipe whose quantizers come from ``qfactory(role) -> quantizer``.

    ``qfactory`` is called once per role each time the fuser builds a plan. Give it
    a stable key with ``qfactory_key=`` or ``@keyed("name")``; otherwise a lambda or
    closure gets a per-object key and every new one re-fuses.
    """

    qfactory: Callable = None  # type: ignore[assignment]
    qfactory_key: str | None = None
    backward_override: str | None = field(default=None, kw_only=True)
    fp8_dpa: bool = field(default=False, kw_only=True)
    fp8_mha: bool = field(default=False, kw_only=True)

    _callable_fields: ClassVar[dict[str, str]] = {"qfactory": "qfactory_key"}

    def _validate(self) -> None:
        if not callable(self.qfactory):
            self._fail("qfactory", "must be a callable taking a QuantizerRole and returning a quantizer")

    def make_quantizer(self, role):
        from .quantization.base import Quantizer

        try:
            quantizer = self.qfactory(role)
        except Exception as err:
            raise RuntimeError(f"CustomRecipe.qfactory raised {type(err).__name__} for role {role}: {err}") from err
        if not isinstance(quantizer, Quantizer):
            raise TypeError(f"CustomRecipe.qfactory must return a te_fuser Quantizer for role {role}, "
                            f"got {type(quantizer).__name__}: {quantizer!r:.80}")
        return quantizer

