"""The row max as a tree computes the running max's value, so every kernel's output should be
the same bits as before: each point of the twelve rows (experiments/2026-11-27-wgmma-o-tma/
points.json, both O stores, both dtypes) built from this tree's templates and from BASE's, run
on the same fresh inputs (lengths no tile's multiple, GQA, a query shorter than the keys),
compared with torch.equal and printed. On the device:
    python experiments/2026-11-28-wgmma-tree-max/same_bits.py BASE_TEMPLATES_DIR"""

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from evoengine import paths  # noqa: E402
from evoengine.compile import compile_source  # noqa: E402
from evoengine.render import make_candidate, render  # noqa: E402
from evoengine.runtime import Kernel, gpu_arch  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402
from evoengine.workload import Workload  # noqa: E402

base_dir = Path(sys.argv[1])
arch, sp = gpu_arch(), SearchSpace.load(paths.SPACES / "wgmma.toml")
points = json.loads((HERE.parent / "2026-11-27-wgmma-o-tma/points.json").read_text())
SHAPES = [(2, 16, 16, 1000, 1000), (1, 32, 8, 777, 1531)]  # B, H, KV, Sq, Sk
same = total = 0
for text, params_list in points["workloads"].items():
    for dtype in ("bf16", "fp16"):
        problem = Workload.parse_spec(text, dtype=dtype).problem()
        for params in params_list:
            for o_store in ("threads", "tma"):
                c = make_candidate(sp, sp.complete({**params, "O_STORE": o_store}), problem, arch)
                built = [Kernel(c, compile_source(render(c, d), arch, c.defines(arch),
                                                  identity=f"{c.identity}@{i}",
                                                  smem_bytes=c.smem_bytes))
                         for i, d in enumerate((None, base_dir))]
                for b, h, kv, sq, sk in SHAPES:
                    t = torch.bfloat16 if dtype == "bf16" else torch.float16
                    d = problem["HEAD_DIM"]
                    q = torch.randn(b, h, sq, d, device="cuda").to(t)
                    k, v = (torch.randn(b, kv, sk, d, device="cuda").to(t) for _ in range(2))
                    eq = torch.equal(built[0](q, k, v), built[1](q, k, v))
                    same += eq
                    total += 1
                    if not eq:
                        print("DIFFERENT", text, dtype, o_store, (b, h, kv, sq, sk), flush=True)
print(f"{same} of {total} outputs the same bits as the base templates'")
