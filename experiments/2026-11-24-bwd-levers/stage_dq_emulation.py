"""Emulates wgmma_bwd's staging of dQ for the bulk reduction (DQ_REDUCE = "bulk"): the quad
exchange and the 16-byte shared stores of ``stage_dq`` in templates/wgmma_bwd/kernel.cu.j2.

    python experiments/2026-11-24-bwd-levers/stage_dq_emulation.py

For each (HEAD_DIM, BLOCK_M, warpgroups) it walks every warpgroup, warp, m64 tile, row half
and chunk pair, gives each lane the (row, column) its wgmma accumulators hold, applies the
shuffle (lane ^ 1) and the store address, and checks that every element of the BLOCK_M x
HEAD_DIM tile is written once, at row * HEAD_DIM + column (dQacc's row-major layout), and that
the 8 lanes of each quarter-warp store to 8 distinct 16-byte bank groups (no conflict).
"""

from __future__ import annotations

SHAPES = [(128, 64, 2), (128, 64, 1), (64, 128, 2), (64, 64, 1), (64, 128, 1), (64, 64, 2),
          (128, 128, 2)]


def accumulator(lane: int, idx: int, top: int, col0: int) -> tuple[int, int]:
    """(row, column) of a thread's wgmma accumulator ``idx`` (m64 fragment: row lane / 4 and
    + 8, columns 8 i + 2 (lane % 4) + {0, 1}); ``top`` is the warp's first row."""
    i, half, e = idx // 4, (idx % 4) // 2, idx % 2
    return top + (lane >> 2) + 8 * half, col0 + 8 * i + 2 * (lane & 3) + e


def emulate(head_dim: int, block_m: int, wgs: int) -> int:
    """Checks the layout; returns the worst count of repeated 16-byte units in a quarter-warp."""
    dq_wg_m = min(wgs, block_m // 64)
    dq_n = head_dim // (wgs // dq_wg_m)
    dq_mt = block_m // 64 // dq_wg_m
    regs = dq_n // 2
    written: dict[int, tuple[int, int]] = {}
    worst = 0
    for wg in range(wgs):
        dq_wm, dq_wn = wg % dq_wg_m, wg // dq_wg_m
        for warp in range(4):
            for mt in range(dq_mt):
                top = 64 * (dq_mt * dq_wm + mt) + 16 * warp
                for r in range(2):
                    for k in range(regs // 8):
                        held = {}
                        for lane in range(32):
                            odd = (lane >> 2) & 1
                            chunk = 2 * (k ^ 1) if odd else 2 * k
                            pair = [accumulator(lane, 4 * c + 2 * r + e, top, dq_wn * dq_n)
                                    for c in (chunk, chunk + 1) for e in (0, 1)]
                            held[lane] = (chunk, lane & 1, pair)
                        stores = []
                        for lane in range(32):
                            chunk, hi, (p0x, p0y, p1x, p1y) = held[lane]
                            _, partner_hi, partner = held[lane ^ 1]
                            got = partner[:2] if partner_hi else partner[2:]
                            row = top + (lane >> 2) + 8 * r
                            at = row * head_dim + dq_wn * dq_n + 2 * (lane & 2)
                            dst = at + 8 * (chunk + hi)
                            values = [*got, p1x, p1y] if hi else [p0x, p0y, *got]
                            for j, v in enumerate(values):
                                assert dst + j not in written, "an element written twice"
                                written[dst + j] = v
                            stores.append(4 * dst)
                        for quarter in range(4):
                            units = {(a % 128) // 16 for a in stores[8 * quarter:8 * quarter + 8]}
                            worst = max(worst, 8 - len(units))
    assert len(written) == block_m * head_dim, "every element of the tile written"
    for address, (row, col) in written.items():
        assert address == row * head_dim + col, f"({row}, {col}) stored at {address}"
    return worst


def main() -> None:
    for d, bm, wgs in SHAPES:
        print(f"HEAD_DIM {d}, BLOCK_M {bm}, {wgs} warpgroup(s): layout ok, repeated bank "
              f"groups {emulate(d, bm, wgs)}")


if __name__ == "__main__":
    main()
