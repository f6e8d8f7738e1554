"""Which parameter of a failing KV_MULTICAST point breaks it: the point, then the point with one
parameter changed at a time, each through validate.check on a few shapes (ok or max error).
    python experiments/2026-11-28-wgmma-kv-multicast/isolate.py
(On the tree of d4415d8, where the wgmma space had KV_MULTICAST; it was dropped after.)"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from evoengine import paths, validate  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.runtime import Kernel, gpu_arch  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402

FAILING = dict(BLOCK_M=64, BLOCK_N=96, STAGES=3, SWIZZLE=32, P_FROM="regs", INTRA_WG_OVERLAP=True,
               PINGPONG=False, PERSISTENT=True, TILE_ORDER="head", SCHEDULER="static",
               PACK_GQA=False, P_BARRIER="warpgroup", O_STAGE="own_or_q", O_STORE="threads",
               KV_MULTICAST=True)
CHANGES = [{}, {"KV_MULTICAST": False}, {"SWIZZLE": 64}, {"SWIZZLE": 128}, {"BLOCK_N": 128},
           {"BLOCK_N": 64}, {"STAGES": 2}, {"BLOCK_M": 128}, {"PERSISTENT": False},
           {"BLOCK_N": 128, "SWIZZLE": 32}, {"BLOCK_N": 64, "SWIZZLE": 128}]
SHAPES = [(2, 4, 4, 257, 257), (1, 1, 1, 128, 1024), (1, 2, 2, 64, 96), (1, 2, 2, 64, 192)]


def main() -> None:
    arch, sp = gpu_arch(), SearchSpace.load(paths.SPACES / "wgmma.toml").with_untested()
    problem = dict(HEAD_DIM=64, DTYPE="fp16", CAUSAL=False)
    for change in CHANGES:
        point = {**FAILING, **change}
        bad = sp.violations(point, problem, arch)
        if bad:
            print(change, "not admitted:", bad)
            continue
        kernel = Kernel.build(make_candidate(sp, point, problem, arch), arch)
        out = []
        for b, h, hkv, sq, sk in SHAPES:
            v = validate.check(kernel, batch=b, heads=h, kv_heads=hkv, seq_q=sq, seq_k=sk,
                               head_dim=64, causal=False, dtype=torch.float16)
            out.append("ok" if v.ok else f"{v.max_err:.3g}")
        print(change, *out, flush=True)


if __name__ == "__main__":
    main()
