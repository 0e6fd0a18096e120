"""Models built from te_fuser ops, with plain-torch twins to compare against."""

from .gpt import (
    GPT, VALIDATION_FRACTION, VOCAB_SIZE, CausalSelfAttention, GPTConfig, TorchGPT, compile_blocks, copy_weights,
    load_stdlib_corpus, parameter_name_map, rename_state_dict, sample_windows, split_corpus, stdlib_source_files,
    torchao_float8,
)

__all__ = [
    "GPTConfig", "GPT", "TorchGPT", "CausalSelfAttention", "copy_weights", "compile_blocks", "torchao_float8",
    "parameter_name_map", "rename_state_dict", "stdlib_source_files", "load_stdlib_corpus", "split_corpus",
    "sample_windows",
    "VOCAB_SIZE", "VALIDATION_FRACTION",
]
