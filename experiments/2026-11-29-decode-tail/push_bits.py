"""The pushed cluster merge (eleventh session) against the template before it, bit for bit.

Each CLUSTER 2 and 8 build of the GPU tests' points (both combines, both row layouts) is built
from the tree's template and from DIR's (`--base-templates`, the template before the change) and
run on the same fresh paged inputs: out and lse must be the same bits, since the merge's
arithmetic and order are the same and only the way the blocks' rows travel changed.

    python experiments/2026-11-29-decode-tail/push_bits.py --base-templates DIR
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HEAD_DIM = 128  # same_bits draws d128 inputs
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-templates", type=Path, required=True)
    args = ap.parse_args()

    import torch

    from evoengine.compile import compile_source
    from evoengine.decode import DecodeKernel
    from evoengine.render import make_candidate, render
    from evoengine.runtime import gpu_arch
    from tests.gpu.test_decode import POINTS, ROW_POINTS, same_bits, space

    arch = gpu_arch()
    jobs = []  # (candidate, dtype, tree source, base source)
    for points, dtype in ((POINTS, "bf16"), (ROW_POINTS, "fp16")):
        for cluster in (2, 8):
            for combine, items in (("kernel", 1), ("fused", 4)):
                for p in points:
                    p = space().complete(dict(p, MERGE="slices", COMBINE=combine,
                                              COMBINE_ITEMS=items, CLUSTER=cluster))
                    problem = dict(HEAD_DIM=HEAD_DIM, DTYPE=dtype, PAGED=True)
                    if space().violations(p, problem, arch):
                        continue
                    cand = make_candidate(space(), p, problem, arch)
                    jobs.append((cand, dtype, render(cand), render(cand, args.base_templates)))

    def base_smem(cand: Any) -> int:
        """The shared memory the template before asked: its merge had one LSE a row for the
        cluster instead of the received rows and the mbarrier."""
        d = cand.derived
        ring = d["RING_BYTES"] + d["PAGE_RING_BYTES"]
        key_warps, block_m = d["KEY_WARPS"], cand.params["BLOCK_M"]
        merge = (key_warps * block_m * (HEAD_DIM + 8) * 4 + 2 * key_warps * block_m * 4
                 + block_m * 4)
        return block_m * HEAD_DIM * 2 + max(ring, merge)

    def build(job: tuple, tag: str, src: str) -> DecodeKernel:
        cand = job[0]
        smem = cand.smem_bytes if tag == "tree" else base_smem(cand)
        c = compile_source(src, arch, dict(cand.defines(arch), EVO_SMEM_BYTES=smem),
                           identity=f"{cand.identity}@push-{tag}", smem_bytes=smem)
        if not c.ok:
            raise SystemExit(f"{cand.identity} {tag}: {c.error}")
        return DecodeKernel(cand, c)
    with ThreadPoolExecutor(8) as pool:
        tree = list(pool.map(lambda j: build(j, "tree", j[2]), jobs))
        base = list(pool.map(lambda j: build(j, "base", j[3]), jobs))
    pairs = [((a, b), j[1]) for a, b, j in zip(tree, base, jobs, strict=True)]
    gen = torch.Generator(device="cuda").manual_seed(11)
    for dtype in ("bf16", "fp16"):
        these = [pair for pair, d in pairs if d == dtype]
        same_bits(these, ((3, [4099, 0, 700], 4, 32), (1, [30000], 1, 64),
                          (2, [5000, 17], 16, 8)),
                  {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype], 64, gen)
        print(f"{dtype}: {len(these)} pairs, the same bits on every call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
