"""How evenly the persistent attention forwards' blocks share their items, modelled
(no GPU): one block an SM works through items (128 queries of one head), the list
running the longest first under the causal mask; an item costs its key tiles (128
keys each) plus a fixed part (its Q, its store). Per case, the busiest block's sum
over the mean, for three ways of dealing the list out:

- ``forwards``: in rounds of one an SM, block i taking each round's i-th item;
- ``mirrored``: rounds dealt forwards and backwards in turn (the kernels' default,
  ``set_hopper_schedule(mirrored=True)``);
- ``greedy``: each item to the block free first (what a shared counter would give).

    python benchmarks/forward_items.py [--sms 132] [--fixed 0.5 1.5] [--cases 4x16x4096 ...]
"""

from __future__ import annotations

import argparse
import heapq


def item_costs(batch_heads: int, tq: int, fixed: float, block: int = 128) -> list[float]:
    """The items' costs in the kernels' order: every (batch, head) at one rank (the
    last query block first), then the next rank."""
    blocks = -(-tq // block)
    return [blocks - rank + fixed for rank in range(blocks) for _ in range(batch_heads)]


def forwards(costs: list[float], sms: int) -> list[float]:
    sums = [0.0] * sms
    for i, cost in enumerate(costs):
        sums[i % sms] += cost
    return sums


def mirrored(costs: list[float], sms: int) -> list[float]:
    sums = [0.0] * sms
    for i, cost in enumerate(costs):
        rnd, j = divmod(i, sms)
        sums[sms - 1 - j if rnd % 2 else j] += cost
    return sums


def greedy(costs: list[float], sms: int) -> list[float]:
    heap = [(0.0, j) for j in range(sms)]
    for cost in costs:
        total, j = heapq.heappop(heap)
        heapq.heappush(heap, (total + cost, j))
    return [total for total, _ in heap]


DEALINGS = {"forwards": forwards, "mirrored": mirrored, "greedy": greedy}


def busiest_over_mean(dealing, costs: list[float], sms: int) -> float:
    return max(dealing(costs, sms)) / (sum(costs) / sms)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--fixed", type=float, nargs="+", default=[0.5, 1.5], help="an item's fixed cost, in key tiles")
    p.add_argument("--cases", nargs="+", default=["4x16x4096", "2x16x8192", "8x16x2048", "16x16x1024"],
                   help="B x H x T (causal, as many queries as keys)")
    args = p.parse_args(argv)
    print(f"{args.sms} SMs; the busiest block's items over the mean, for an item's fixed cost of {args.fixed} tiles")
    for case in args.cases:
        b, h, t = (int(v) for v in case.split("x"))
        cells = []
        for name, dealing in DEALINGS.items():
            ratios = [busiest_over_mean(dealing, item_costs(b * h, t, fixed), args.sms) for fixed in args.fixed]
            cells.append(f"{name} " + "-".join(f"{r:.3f}" for r in ratios))
        print(f"  {case:12s} {len(item_costs(b * h, t, 0)):5d} items: " + ", ".join(cells))


if __name__ == "__main__":
    main()
