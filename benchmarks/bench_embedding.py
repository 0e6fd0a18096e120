"""The embedding's weight gradient at the yardstick GPT's batch: te_fuser's kernel
beside torch's accumulating ``index_put_`` (deterministic, what the op ran before)
and torch's ``embedding_dense_backward`` (what ``nn.Embedding`` runs), on the ids of
real text (the standard library's source: the space about 30% of the bytes) and on
uniform ids, and at a launch-bound size (256 tokens, width 64). GPU time from CUDA
graphs, ms, with the fraction of the device copy's rate at reading dy once; before
timing, each arm's result is checked against float64 and for the same bits twice.

    python benchmarks/bench_embedding.py [--tokens 16384] [--dim 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Row  # noqa: E402

from te_fuser.kernels.triton.embedding import embedding_grad  # noqa: E402
from te_fuser.models.gpt import load_stdlib_corpus, sample_windows  # noqa: E402

VOCAB = 256


def _arms(ids: torch.Tensor, dy: torch.Tensor) -> dict:
    def index_put():
        return torch.zeros(VOCAB, dy.shape[1], device=dy.device).index_put_((ids,), dy, accumulate=True)

    return {
        "te_fuser (sorted, 32 rows a step)": lambda: embedding_grad(ids, dy, VOCAB),
        "torch index_put_ accumulate": index_put,
        "torch embedding_dense_backward": lambda: torch.ops.aten.embedding_dense_backward(dy, ids, VOCAB, -1, False),
    }


def bench(tokens: int, dim: int, copy_tbs: float, seq: int = 1024) -> list[Row]:
    data = load_stdlib_corpus(8_000_000).cuda()
    text = sample_windows(data, tokens // seq, seq - 1, torch.Generator().manual_seed(0)).reshape(-1)  # (tokens,)
    uniform = torch.randint(0, VOCAB, (tokens,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    dy = torch.randn(tokens, dim, device="cuda")
    rows = []
    for label, ids in (("real text", text), ("uniform ids", uniform)):
        exact = torch.zeros(VOCAB, dim, dtype=torch.float64, device="cuda").index_add_(0, ids, dy.double())
        most = int(torch.bincount(ids, minlength=VOCAB).max())
        times = {}
        for name, fn in _arms(ids, dy).items():
            first, second = fn(), fn()
            worst = ((first.double() - exact).abs().max() / exact.abs().max()).item()
            note = f"{'same bits' if torch.equal(first, second) else 'BITS DIFFER'} twice, off by {worst:.1e}"
            times[name] = harness.graph_time_ms(fn)
            tbs = tokens * dim * 4 / (times[name] * 1e-3) / 1e12
            rows.append(Row("embedding-grad", f"{name}, {label} (an id read {most}x)", "cuda", f"{tokens}x{dim} fp32",
                            times[name], tbs, "TB/s", tbs / copy_tbs, note=note))
        ours = rows[-3]
        ours.vs_peer, ours.peer = times["torch index_put_ accumulate"] / ours.ms, "index_put_"
        for row in rows[-3:]:
            harness.progress(row)
    return rows


def main(argv=None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--csv", default=None, help="results CSV (default benchmarks/out/results.csv, untracked)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    copy_tbs = harness.copy_ceiling_tbs()
    rows = bench(args.tokens, args.dim, copy_tbs) + bench(256, 64, copy_tbs, seq=64)  # and a launch-bound size
    harness.append_csv(rows, args.csv)
    harness.print_table(rows, "the embedding's weight gradient")
    return rows


if __name__ == "__main__":
    main()
