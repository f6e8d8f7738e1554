"""Model of causal tile schedules for the wgmma grid (docs/NOTES.md, "causal tile order").

    python experiments/2026-11-22-wgmma-causal/causal_tile_order_model.py --budget-mb 16

A tile costs its key blocks plus c0 = 1 block of fixed overhead; 132 SMs, one block each.
"greedy": the non-persistent grid (a free SM takes the next tile in order); "static":
persistent round-robin (block b takes tiles b, b + 132, ...); "snake": the same with every
other round reversed; "dynamic": the kernel's SCHEDULER=dynamic, block b starts at tile b and
claims its next from a counter as its producer issues the current tile's last key block,
LEAD = 3 cost units before the tile ends (STAGES 2 blocks and the one in flight); "ahead":
the same claiming as each tile starts, a whole tile early. Prints makespan / ideal (total
work / 132) and the most heads whose K/V a window of 132 consecutive tiles touches. A model,
not a measurement.
"""

from __future__ import annotations

import argparse
import heapq

SMS = 132
C0 = 1.0
LEAD = 3.0
WORKLOADS = [(16, 16, 2048, 64), (8, 16, 4096, 128), (2, 32, 8192, 128)]
TILES = [(128, 128), (128, 64), (192, 128), (128, 176)]


def order(b: int, h: int, s: int, bm: int, bn: int, kind: str, group: int
          ) -> list[tuple[int, int]]:
    """(cost in key blocks, batch x head) of each tile, in the kernel's tile_at order."""
    mb, bh_count = (s + bm - 1) // bm, b * h
    out = []
    for t in range(mb * bh_count):
        if kind == "head":
            bh, m = t // mb, mb - 1 - t % mb
        else:
            section = t // (group * mb)
            size = min(group, bh_count - section * group)
            r = t - section * group * mb
            m, bh = mb - 1 - r // size, section * group + r % size
        out.append(((min(s, (m + 1) * bm) + bn - 1) // bn, bh))
    return out


def greedy(tiles: list[tuple[int, int]]) -> float:
    free = [0.0] * SMS
    for cost, _ in tiles:
        heapq.heappush(free, heapq.heappop(free) + cost + C0)
    return max(free)


def static(tiles: list[tuple[int, int]], snake: bool) -> float:
    load = [0.0] * SMS
    for t in range(len(tiles)):
        k, blk = divmod(t, SMS)
        in_round = min(SMS, len(tiles) - k * SMS)
        pos = k * SMS + (in_round - 1 - blk if snake and k % 2 else blk)
        load[blk] += tiles[pos][0] + C0
    return max(load)


def dynamic(tiles: list[tuple[int, int]], lead: float) -> float:
    """Blocks claim their next tile `lead` cost units before the current one ends (or as it
    starts, if it is shorter); float("inf"): as it starts."""
    # (when its block claims the next tile, start, tile) of each tile running
    events = [(max(0.0, tiles[t][0] + C0 - lead), 0.0, t) for t in range(min(SMS, len(tiles)))]
    heapq.heapify(events)
    claimed, end = len(events), 0.0
    while events:
        _, start, t = heapq.heappop(events)
        finish = start + tiles[t][0] + C0
        end = max(end, finish)
        if claimed < len(tiles):
            nxt, claimed = claimed, claimed + 1
            heapq.heappush(events, (max(finish, finish + tiles[nxt][0] + C0 - lead), finish, nxt))
    return end


def heads_per_wave(tiles: list[tuple[int, int]]) -> int:
    return max(len({bh for _, bh in tiles[i:i + SMS]})
               for i in range(0, max(1, len(tiles) - SMS), SMS // 4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-mb", type=int, default=16, help="the l2 order's K/V budget")
    args = ap.parse_args()
    for b, h, s, d in WORKLOADS:
        kv_bytes = 4 * s * d
        group = max(1, (args.budget_mb << 20) // kv_bytes)
        for bm, bn in TILES:
            for kind in ("head", "l2"):
                tiles = order(b, h, s, bm, bn, kind, group)
                ideal = (sum(c for c, _ in tiles) + C0 * len(tiles)) / SMS
                heads = heads_per_wave(tiles)
                print(f"{b},{h},{s},{d} BM{bm} BN{bn} {kind:4} (group {group:2}): greedy "
                      f"{greedy(tiles) / ideal:.3f} static {static(tiles, False) / ideal:.3f} "
                      f"snake {static(tiles, True) / ideal:.3f} "
                      f"dynamic {dynamic(tiles, LEAD) / ideal:.3f} "
                      f"ahead {dynamic(tiles, float('inf')) / ideal:.3f}  heads/wave {heads} "
                      f"({heads * kv_bytes >> 20} MB)")


if __name__ == "__main__":
    main()
