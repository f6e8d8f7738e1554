"""The makespan of the dynamic scheduler's head order on 132 SMs, one block each, for the
shapes of points.json: a full 192-row tile costs 1, the short last m-block of a head SHORT
(the share of a full tile's time it keeps the SM; its warpgroups past the end skip their
GEMMs). Efficiency = the work's ideal spread (total cost / 132) over the makespan.

    python experiments/2026-11-30-wgmma-waves/model.py
"""

import heapq
import json
import math
from pathlib import Path

SMS, BLOCK_M = 132, 192
SHORT = {64: (0.4, 0.5, 0.6), 128: (0.7, 0.75, 0.85)}  # by the short tile's rows


def makespan(costs: list[float]) -> float:
    free = [0.0] * SMS
    for c in costs:  # whoever is free next takes the next tile (the dynamic scheduler)
        heapq.heapreplace(free, free[0] + c)
    return max(free)


def main() -> None:
    here = Path(__file__).parent
    for text in json.loads((here / "points.json").read_text())["workloads"]:
        b, h, s, _ = map(int, text.split(","))
        m_blocks, rows = math.ceil(s / BLOCK_M), s % BLOCK_M
        effs = []
        for c in SHORT.get(rows, (1.0,)):
            costs = [c if rows and m == m_blocks - 1 else 1.0 for _ in range(b * h)
                     for m in range(m_blocks)]
            effs.append(sum(costs) / SMS / makespan(costs))
        print(f"{text:16} tiles {b * h * m_blocks:5}  rounds {b * h * m_blocks / SMS:6.2f}  "
              f"efficiency {min(effs):.3f}-{max(effs):.3f}")


if __name__ == "__main__":
    main()
