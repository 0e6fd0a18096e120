"""A small byte-level GPT built from te_fuser ops: the project's yardstick model.

- :func:`load_stdlib_corpus` reads real text that every machine has, the Python
  standard library's own ``.py`` sources, in sorted path order; :func:`split_corpus`
  keeps the last 5% as the validation split; :func:`sample_windows` draws (B, T+1)
  byte windows with a seeded generator.
- :class:`GPT` is a pre-norm decoder. Each block is two ``te.ops.Sequential``
  sub-layers, each called as ``sub(x, x)`` so that its last op, ``AddExtraInput``,
  adds the residual. With ``GPTConfig.attention="te"`` (the default) the whole
  model is te_fuser ops, ``te.ops.Embedding`` for the tokens and rotary position
  embeddings in attention:

      attention: LayerNorm -> Linear(d, 3d) -> RotaryEmbedding -> DotProductAttention -> Linear(d, d) -> + x
      MLP:       LayerNorm -> Linear(d, 4d) -> GELU (tanh) -> Linear(4d, d) -> + x

  so that a recipe's ``fp8_dpa`` / ``fp8_mha`` reach attention and its boundaries.
  With ``attention="sdpa"`` the attention core is ``CausalSelfAttention``, a plain
  ``nn.Module`` (torch's SDPA) run as it is between the fused groups, and the
  embeddings are ``nn.Embedding`` tokens plus learned positions.
  With ``GPTConfig.layer="one_sequential"`` (and ``attention="te"``) a block is one
  ``Sequential`` called as ``layer(x)``, its two residuals on extra-tensor channels
  (``MakeExtraOutput(channel=...)`` ... ``AddExtraInput(channel=...)``).
- :class:`TorchGPT` is the same network in plain torch (``nn.Linear``,
  ``nn.LayerNorm``, ``nn.GELU(approximate="tanh")``, te's GELU; under
  ``attention="te"`` the same rotary embedding in plain torch before SDPA), module
  for module; :func:`copy_weights` makes it start from a te model's weights and
  :func:`parameter_name_map` / :func:`rename_state_dict` convert state dicts
  between the two.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from .. import ops
from ..checkpoint import checkpoint as te_checkpoint
from ..ops.basic.rotary import apply_rotary, rotary_tables

__all__ = [
    "GPTConfig", "GPT", "TorchGPT", "CausalSelfAttention", "RotaryCausalSelfAttention", "copy_weights", "parameter_name_map",
    "rename_state_dict", "compile_blocks", "torchao_float8", "stdlib_source_files", "load_stdlib_corpus",
    "split_corpus", "sample_windows",
    "VOCAB_SIZE", "VALIDATION_FRACTION",
]

VOCAB_SIZE = 256  # bytes
VALIDATION_FRACTION = 0.05
ATTENTION_KINDS = ("sdpa", "te")
LAYER_KINDS = ("two_sequentials", "one_sequential")
ROPE_BASE = 10000.0
# Folders of the standard library left out of the corpus: installed packages, the
# test suites, and the IDE and the 2to3 tool with their fixtures.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model and of one training batch."""

    n_layer: int
    d_model: int
    n_head: int
    d_ffn: int
    seq_len: int
    batch_size: int
    vocab_size: int = VOCAB_SIZE
    attention: str = "te"  # "te": te_fuser ops throughout; "sdpa": torch's SDPA between the fused groups
    # "two_sequentials": each sub-layer a Sequential called as seq(x, x); "one_sequential" (attention="te"):
    # a block is one Sequential whose residuals stay inside on extra-tensor channels
    layer: str = "two_sequentials"
    # training recomputes each block's activations in the backward instead of keeping them
    # (te.checkpoint; torch.utils.checkpoint for the torch twin)
    checkpoint: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"GPTConfig.attention: must be one of {list(ATTENTION_KINDS)}, got {self.attention!r}")
        if self.layer not in LAYER_KINDS or (self.layer == "one_sequential" and self.attention != "te"):
            raise ValueError(f"GPTConfig.layer: must be one of {list(LAYER_KINDS)} ('one_sequential' with "
                             f"attention='te': SDPA is a plain module, which a channel cannot cross), "
                             f"got {self.layer!r} with attention={self.attention!r}")
        if self.checkpoint is not True and self.checkpoint is not False:
            raise ValueError(f"GPTConfig.checkpoint: must be True or False, got {self.checkpoint!r}")
        for f in dataclasses.fields(self):
            if f.name in ("attention", "layer", "checkpoint"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{f.name}: must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.n_head: {self.n_head} must divide d_model ({self.d_model})")

    @classmethod
    def smoke(cls) -> "GPTConfig":
        """A few seconds of training on a CPU; head dim 32, the smallest FP8 attention takes."""
        return cls(n_layer=2, d_model=64, n_head=2, d_ffn=256, seq_len=64, batch_size=8)

    @classmethod
    def gpu(cls) -> "GPTConfig":
        """The yardstick of DESIGN.md: 8 layers, d 1024, seq 1024, batch 16."""
        return cls(n_layer=8, d_model=1024, n_head=16, d_ffn=4096, seq_len=1024, batch_size=16)

    def replace(self, **changes) -> "GPTConfig":
        return dataclasses.replace(self, **changes)


# -- the corpus --------------------------------------------------------------------


def stdlib_source_files(root: str | None = None) -> list[str]:
    """The standard library's ``.py`` files (outside the skipped folders), sorted by
    their path relative to ``root`` (default: the folder of ``os``)."""
    root = root or os.path.dirname(os.__file__)
    found = []
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        found += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")]
    return [os.path.join(root, rel) for rel in sorted(found)]


def load_stdlib_corpus(max_bytes: int, root: str | None = None) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the concatenated sources, as a uint8 tensor."""
    if max_bytes <= 0:
        raise ValueError(f"load_stdlib_corpus: max_bytes must be positive, got {max_bytes}")
    chunks, total = [], 0
    for path in stdlib_source_files(root):
        with open(path, "rb") as f:
            chunks.append(f.read(max_bytes - total))
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def split_corpus(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, validation)``: the validation split is the last 5% by position."""
    n_val = max(1, int(len(data) * VALIDATION_FRACTION))
    return data[:-n_val], data[-n_val:]


def sample_windows(data: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """``batch`` windows of ``seq_len + 1`` consecutive bytes at random offsets, as
    int64 (B, T+1): inputs are ``[:, :-1]``, next-byte targets ``[:, 1:]``. The
    offsets are drawn on the host (``generator``) and reach a GPU without a wait."""
    if len(data) < seq_len + 1:
        raise ValueError(f"sample_windows: a window of {seq_len + 1} bytes does not fit {len(data)} bytes of data")
    starts = torch.randint(0, len(data) - seq_len, (batch,), generator=generator)  # (B,)
    offsets = torch.arange(seq_len + 1)  # (T+1,)
    index = starts[:, None] + offsets  # (B, T+1), on the host
    if data.is_cuda:
        # from pinned memory, without waiting: a copy from pageable memory first waits
        # for everything queued on the stream, so a host that launches ahead of the
        # GPU would start every step on an idle GPU
        index = index.pin_memory().to(data.device, non_blocking=True)
    else:
        index = index.to(data.device)
    return data[index].long()  # (B, T+1)


# -- the models --------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention on packed ``q, k, v``: (B, T, 3d) -> (B, T, d)."""

    def __init__(self, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        batch, seq, three_d = qkv.shape
        d = three_d // 3
        heads = qkv.view(batch, seq, 3, self.n_head, d // self.n_head)  # (B, T, 3, H, D)
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # each (B, H, T, D)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return y.transpose(1, 2).reshape(batch, seq, d)  # (B, T, d)


class RotaryCausalSelfAttention(nn.Module):
    """:class:`CausalSelfAttention` with rotary position embeddings of q and k (the
    tables and rotation of ``te.ops.RotaryEmbedding``): (B, T, 3d) -> (B, T, d)."""

    def __init__(self, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        # (seq, head_dim, device) -> (cos, sin), made once as a torch user would: made
        # on every call, the tables' copies from pageable host memory would wait for
        # the GPU each layer and hold the twin's host back
        self._tables: dict = {}

    def tables(self, seq: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq, head_dim, device)
        found = self._tables.get(key)
        if found is None:
            found = self._tables[key] = rotary_tables(seq, head_dim, ROPE_BASE, 0, device)
        return found

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        batch, seq, three_d = qkv.shape
        d = three_d // 3
        head_dim = d // self.n_head
        heads = qkv.view(batch, seq, 3 * self.n_head, head_dim)  # (B, T, 3H, D)
        cos, sin = self.tables(seq, head_dim, qkv.device)
        qk = apply_rotary(heads[:, :, :2 * self.n_head].float(), cos, sin).to(qkv.dtype)
        q, k = qk.split(self.n_head, dim=2)
        v = heads[:, :, 2 * self.n_head:]
        y = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)  # (B, H, T, D)
        return y.transpose(1, 2).reshape(batch, seq, d)  # (B, T, d)


EMBEDDING_STD = 0.02  # the embedding tables' init scale, after their modules' own draw


class _TokenEmbedding(nn.Module):
    """Token embeddings alone (the rotary variant's positions are in attention): (B, T) -> (B, T, d)."""

    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        self.tokens = table
        nn.init.normal_(table.weight, std=EMBEDDING_STD)

    def reset_parameters(self) -> None:
        """The table drawn again as construction drew it: its own init, then the model's scale (EMBEDDING_STD)."""
        self.tokens.reset_parameters()
        nn.init.normal_(self.tokens.weight, std=EMBEDDING_STD)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx)


class _Embeddings(nn.Module):
    """Token plus learned position embeddings: (B, T) bytes -> (B, T, d)."""

    def __init__(self, config: GPTConfig, device) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.d_model, device=device)
        self.positions = nn.Embedding(config.seq_len, config.d_model, device=device)
        for table in (self.tokens, self.positions):
            nn.init.normal_(table.weight, std=EMBEDDING_STD)

    def reset_parameters(self) -> None:
        """The tables drawn again as construction drew them: each its own init, then
        the model's scale (EMBEDDING_STD)."""
        for table in (self.tokens, self.positions):
            table.reset_parameters()
        for table in (self.tokens, self.positions):
            nn.init.normal_(table.weight, std=EMBEDDING_STD)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        return self.tokens(idx) + self.positions(pos)  # (B, T, d)


class Block(nn.Module):
    """One pre-norm decoder block of te ops: two residual sub-layers."""

    def __init__(self, config: GPTConfig, device) -> None:
        super().__init__()
        d, heads = config.d_model, config.n_head
        core = ([ops.RotaryEmbedding(heads, d // heads, base=ROPE_BASE, name="rope"),
                 ops.DotProductAttention(heads, d // heads, causal=True, name="attn")]
                if config.attention == "te" else [CausalSelfAttention(heads)])
        one = config.layer == "one_sequential"  # the residuals on channels inside one Sequential
        attn = [ops.LayerNorm(d, device=device), ops.Linear(d, 3 * d, device=device, name="qkv"), *core,
                ops.Linear(d, d, device=device, name="proj"), ops.AddExtraInput(channel="attn_res" if one else None)]
        mlp = [ops.LayerNorm(d, device=device), ops.Linear(d, config.d_ffn, device=device, name="fc1"), ops.GELU(),
               ops.Linear(config.d_ffn, d, device=device, name="fc2"),
               ops.AddExtraInput(channel="mlp_res" if one else None)]
        if one:
            self.layer = ops.Sequential(ops.MakeExtraOutput(channel="attn_res"), *attn,
                                        ops.MakeExtraOutput(channel="mlp_res"), *mlp)
        else:
            self.attn, self.mlp = ops.Sequential(*attn), ops.Sequential(*mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        if "layer" in self._modules:
            return self.layer(x)
        x = self.attn(x, x)
        return self.mlp(x, x)


class GPT(nn.Module):
    """The te_fuser GPT: (B, T) bytes -> (B, T, 256) logits."""

    def __init__(self, config: GPTConfig, device=None) -> None:
        super().__init__()
        self.config = config
        self.embed = (_TokenEmbedding(ops.Embedding(config.vocab_size, config.d_model, device=device))
                      if config.attention == "te" else _Embeddings(config, device))
        self.blocks = nn.ModuleList(Block(config, device) for _ in range(config.n_layer))
        self.head = ops.Sequential(
            ops.LayerNorm(config.d_model, device=device),
            ops.Linear(config.d_model, config.vocab_size, bias=False, device=device, name="lm_head"),
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)  # (B, T, d)
        recompute = self.config.checkpoint and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = te_checkpoint(block, x) if recompute else block(x)
        return self.head(x)  # (B, T, V)

    def init_weights(self) -> None:
        """Every parameter drawn again as construction drew it, in the same order: a
        model made on the meta device (``with torch.device("meta")``, then
        ``to_empty(device=...)``, under FSDP2 after ``fully_shard``) and initialised
        under a seed holds what one built directly under that seed holds."""
        ops.reset_parameters(self)

    def sequentials(self) -> list[ops.Sequential]:
        return [m for m in self.modules() if isinstance(m, ops.Sequential)]

    def refusions(self) -> int:
        """Plans built so far, summed over the model's Sequentials."""
        return sum(seq.fusion_stats().builds for seq in self.sequentials())


class TorchBlock(nn.Module):
    """:class:`Block` in plain torch, module for module. With ``config.checkpoint``
    it recomputes itself in the backward (``torch.utils.checkpoint`` inside its own
    forward, so that a ``torch.compile``d block traces the checkpoint and recomputes
    its own graph: an eager checkpoint around a compiled block recomputes a graph
    whose saved tensors need not match the forward's, which torch rejects)."""

    def __init__(self, config: GPTConfig, device) -> None:
        super().__init__()
        d = config.d_model
        self.checkpoint = config.checkpoint
        self.attn = nn.Sequential(
            nn.LayerNorm(d, device=device),
            nn.Linear(d, 3 * d, device=device),
            RotaryCausalSelfAttention(config.n_head) if config.attention == "te" else CausalSelfAttention(config.n_head),
            nn.Linear(d, d, device=device),
        )
        self.mlp = nn.Sequential(
            nn.LayerNorm(d, device=device),
            nn.Linear(d, config.d_ffn, device=device),
            nn.GELU(approximate="tanh"),
            nn.Linear(config.d_ffn, d, device=device),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        if self.checkpoint and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._layers, x, use_reentrant=False)
        return self._layers(x)

    def _layers(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class TorchGPT(nn.Module):
    """:class:`GPT` in plain torch: the baseline, with the same parameters in the same order."""

    def __init__(self, config: GPTConfig, device=None) -> None:
        super().__init__()
        self.config = config
        self.embed = (_TokenEmbedding(nn.Embedding(config.vocab_size, config.d_model, device=device))
                      if config.attention == "te" else _Embeddings(config, device))
        self.blocks = nn.ModuleList(TorchBlock(config, device) for _ in range(config.n_layer))
        self.head = nn.Sequential(
            nn.LayerNorm(config.d_model, device=device),
            nn.Linear(config.d_model, config.vocab_size, bias=False, device=device),
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)  # (B, T, d)
        for block in self.blocks:  # each recomputes itself under config.checkpoint
            x = block(x)
        return self.head(x)  # (B, T, V)

    def init_weights(self) -> None:
        """Every parameter drawn again as construction drew it, in the same order: a
        model made on the meta device (``with torch.device("meta")``, then
        ``to_empty(device=...)``, under FSDP2 after ``fully_shard``) and initialised
        under a seed holds what one built directly under that seed holds."""
        ops.reset_parameters(self)


# -- between the two ---------------------------------------------------------------

_TE_WEIGHTED = (nn.Embedding, ops.Embedding, ops.LayerNorm, ops.Linear)
_TORCH_WEIGHTED = (nn.Embedding, nn.LayerNorm, nn.Linear)


def _weighted_modules(model: nn.Module, kinds: tuple) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, kinds)]


def parameter_name_map(te_model: GPT, torch_model: TorchGPT) -> dict[str, str]:
    """Each te parameter's state-dict key mapped to its twin's in the torch model
    (te's modules have their torch counterparts' keys: ``weight``, ``bias``)."""
    te_mods = _weighted_modules(te_model, _TE_WEIGHTED)
    torch_mods = _weighted_modules(torch_model, _TORCH_WEIGHTED)
    if len(te_mods) != len(torch_mods):
        raise ValueError(f"parameter_name_map: {len(te_mods)} te modules with weights, {len(torch_mods)} in torch")
    names = {}
    for (te_name, te_mod), (torch_name, torch_mod) in zip(te_mods, torch_mods):
        for key, torch_w in torch_mod.named_parameters():
            te_w = getattr(te_mod, key)
            if te_w is None or te_w.shape != torch_w.shape:
                raise ValueError(f"parameter_name_map: {te_name}.{key} is "
                                 f"{None if te_w is None else tuple(te_w.shape)} but {torch_name}.{key} is "
                                 f"{tuple(torch_w.shape)}")
            names[f"{te_name}.{key}"] = f"{torch_name}.{key}"
    return names


def rename_state_dict(state: dict, names: dict[str, str]) -> dict:
    """``state``'s parameters under their names in the other model: pass
    :func:`parameter_name_map` for te -> torch, its inverse for torch -> te. Entries
    without a twin (te's quantizer state) are left out."""
    return {names[k]: v for k, v in state.items() if k in names}


@torch.no_grad()
def copy_weights(te_model: GPT, torch_model: TorchGPT) -> None:
    """Make ``torch_model``'s parameters equal to ``te_model``'s."""
    names = parameter_name_map(te_model, torch_model)
    torch_model.load_state_dict(rename_state_dict(te_model.state_dict(), names))


# -- the peers ---------------------------------------------------------------------


def compile_blocks(model: TorchGPT, reset: bool = True) -> TorchGPT:
    """``model`` with each block ``torch.compile``d (the embedding, the final norm and
    the head stay eager, as the loss around them). ``reset``: dynamo starts clean, as
    in a process of the model's own (a compiled twin and a torchao twin run the same
    block code, whose entries from the other would be checked first and count
    against its recompile limit); a caller timing both in one process passes False
    and raises the limit."""
    if reset:
        torch._dynamo.reset()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block)
    return model


def torchao_float8(twin: TorchGPT, reset: bool = True) -> nn.Module:
    """The twin converted by torchao's float8 training (tensorwise scaling), its blocks
    compiled (:func:`compile_blocks`): the peer a te model is measured against. Needs
    torchao; the conversion swaps the twin's linears in place."""
    from torchao.float8 import convert_to_float8_training

    return compile_blocks(convert_to_float8_training(twin), reset)
