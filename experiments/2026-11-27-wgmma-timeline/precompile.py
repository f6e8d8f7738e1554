"""Fill the compile cache with tests/gpu/test_kernels.py's twins of one new value (each point of
VALUE_TWINS whose PARAM is VALUE, and its legacy twin, on every problem) in one parallel batch,
and write the tests' node ids to ids.txt for pytest:
    python experiments/2026-11-27-wgmma-timeline/precompile.py O_STORE tma && \
        python -m pytest -q $(cat experiments/2026-11-27-wgmma-timeline/ids.txt)
(943e50f's tree ran it for PV_WAIT after_softmax.)"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from evoengine.compile import compile_many  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.runtime import gpu_arch  # noqa: E402
from tests.gpu.test_kernels import PROBLEMS, VALUE_TWINS, space  # noqa: E402


def main() -> None:  # guarded: compile_many's workers are spawned and import this file
    if len(sys.argv) != 3:
        raise SystemExit("usage: precompile.py PARAM VALUE (e.g. O_STORE tma, TILE_OVERLAP True)")
    PARAM, VALUE = sys.argv[1], sys.argv[2]
    VALUE = {"True": True, "False": False}.get(VALUE, int(VALUE) if VALUE.isdigit() else VALUE)
    TWINS = [i for i, (point, _) in enumerate(VALUE_TWINS) if point.get(PARAM) == VALUE]
    arch, sp = gpu_arch(), space("wgmma").with_untested()
    cands, ids = {}, []
    for problem in PROBLEMS:
        pid = f"d{problem['HEAD_DIM']}-{problem['DTYPE']}-{problem['CAUSAL']}"
        for i in TWINS:
            point, legacy = VALUE_TWINS[i]
            ids.append(f"tests/gpu/test_kernels.py::test_wgmma_value_is_its_twin[{pid}-{i}]")
            for p in (point, {**point, **legacy}):
                if not sp.violations(p, problem, arch):
                    c = make_candidate(sp, p, problem, arch)
                    cands[c.identity] = c
    todo = list(cands.values())
    bad = [c.identity for c, r in zip(todo, compile_many(todo, arch), strict=True) if not r.ok]
    (HERE / "ids.txt").write_text("\n".join(ids) + "\n")
    print(f"{len(todo)} compiled, {len(bad)} failed; {len(ids)} tests", *bad, sep="\n")


if __name__ == "__main__":
    main()
