"""The batch-1 decode tail: the combine kernel's latency and the cluster merge's last barrier
(2026-11-29, tenth session; issue #18).

The trace of 2026-11-29 (docs/NOTES.md, tenth session) has the combine kernel end 3.3-3.4 us
after the main kernel on every batch-1 32K row, 2.3-2.7 us of it after its wait returned. The
rendered source is patched (the template is not), one variant a patch:

- base: as the tree renders it;
- once: combine_quad issues a thread's loads of up to 8 splits at once (LSE and parts), then
  merges them (online over chunks of 8 where there are more splits);
- dry: "once" in a __noinline__ function that the combine kernel also runs before its
  griddepcontrol.wait on the stale parts, its result dropped (the same instructions fetched
  early; loads through L2 only, so nothing stale is left in L1);
- relaxed: the cluster merge's last barrier arrives without release semantics;
- dry+relaxed;
- tree: the tree's template as it is (with --base-templates DIR, the others are patches of the
  template under DIR: the tree's before these changes, for an A/B in one process);
- tree-int: the tree's, the combine kernel's index arithmetic in 32 bits (the patch's; added
  after the run of 2026-11-29 left the tree 3% behind the patch at 4K; run once, beside the
  eleventh session's batched write-out, later reverted: `...-decode-merge-batches.json`).
  A `tree-write` variant, for that batched tree, went with its revert.

Every variant of every point goes through the criterion on every row first; then graph replay,
rounds interleaved; then one traced launch of each (trace.py's marks) on the first two rows.

Usage: python experiments/2026-11-29-decode-tail/variants.py --out FILE [--rounds 5]
           [--base-templates DIR --variants base dry+relaxed tree]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

POINTS = {
    "m32w8": dict(BLOCK_N=128, BLOCK_M=32, NUM_WARPS=8, ROW_GROUPS=2, STAGES=3, CLUSTER=2),
    "m16w4": dict(BLOCK_N=128, BLOCK_M=16, NUM_WARPS=4, ROW_GROUPS=1, STAGES=3, CLUSTER=2),
}
BASE = dict(VEC_BYTES=16, L2_PREFETCH=0, MERGE="slices", SPLIT_POLICY="waves", SPLITS=1,
            COMBINE="kernel", COMBINE_ITEMS=1, PAGE_STAGING="regs",
            COMBINE_LAUNCH="programmatic", MMA="sync")
WORKLOADS = ["decode-b1-q4-h64-kv8-d128-c32768-paged64-bf16",
             "decode-b1-q1-h64-kv8-d128-c32768-paged64-bf16",
             "decode-b1-q4-h64-kv8-d128-c32768-contig-bf16",
             "decode-b1-q4-h64-kv8-d128-c4096-paged64-bf16",
             "decode-b1-q1-h32-kv8-d128-c131072-paged64-bf16",
             "decode-b8-q4-h64-kv8-d128-c32768-paged64-bf16"]
VARIANTS = ("base", "once", "dry", "relaxed", "dry+relaxed", "tree", "tree-int")

QUAD_HEAD = "template <bool COHERENT>\n__device__ __forceinline__ void combine_quad("
QUAD_END = "\n// The fused combine with ITEMS"
# The at-once merge of one quad; LOAD(p) is the load expression of pointer p.
ONCE_BODY = r"""  using namespace cfg;
  constexpr int CHUNK = 8;
  float m = neg_inf(), total = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = 0; s0 < splits; s0 += CHUNK) {
    float lse[CHUNK];
    float4 o[CHUNK];
#pragma unroll
    for (int k = 0; k < CHUNK; ++k) {  // every load of the chunk in flight together
      const int s = s0 + k;
      if (s < splits) {
        lse[k] = LOADF(LSE_part + s * rows + row);
        o[k] = LOAD4(reinterpret_cast<const float4*>(O_part + (s * rows + row) * HEAD_DIM + c));
      } else {
        lse[k] = neg_inf();
        o[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    float cm = m;
#pragma unroll
    for (int k = 0; k < CHUNK; ++k) cm = fmaxf(cm, lse[k]);
    if (cm == neg_inf()) continue;
    const float scale = fast_exp2(m - cm);  // 0 on the first chunk that sees a key
    total *= scale;
    acc.x *= scale;
    acc.y *= scale;
    acc.z *= scale;
    acc.w *= scale;
#pragma unroll
    for (int k = 0; k < CHUNK; ++k) {
      const float w = fast_exp2(lse[k] - cm);
      total += w;
      acc.x += w * o[k].x;
      acc.y += w * o[k].y;
      acc.z += w * o[k].z;
      acc.w += w * o[k].w;
    }
    m = cm;
  }
"""
ONCE_QUAD = (
    "template <bool COHERENT>\n__device__ __forceinline__ void combine_quad(\n"
    "    const float* __restrict__ O_part, const float* __restrict__ LSE_part,\n"
    "    elem_t* __restrict__ O, float* __restrict__ LSE, long long rows, long long row, int c,\n"
    "    int b, int token, int head, int q_len, int q_heads, int splits, long long o_sb,\n"
    "    long long o_ss, long long o_sh) {\n"
    + ONCE_BODY.replace("LOADF(", "(COHERENT ? __ldcg(").replace(
        "LOAD4(", "(COHERENT ? __ldcg(")
    .replace("lse[k] = (COHERENT ? __ldcg(LSE_part + s * rows + row);",
             "lse[k] = COHERENT ? __ldcg(LSE_part + s * rows + row) : LSE_part[s * rows + row];")
    .replace("o[k] = (COHERENT ? __ldcg(reinterpret_cast<const float4*>(O_part + (s * rows + row)"
             " * HEAD_DIM + c));",
             "{ const float4* at = reinterpret_cast<const float4*>(O_part + (s * rows + row) * "
             "HEAD_DIM + c);\n        o[k] = COHERENT ? __ldcg(at) : *at; }")
    + "  store_quad(O, LSE, acc, total, m, b, token, head, c, q_len, q_heads, o_sb, o_ss, o_sh);\n"
    "}\n")
COLD_QUAD = (
    "__device__ __noinline__ void combine_quad_cold(\n"
    "    const float* __restrict__ O_part, const float* __restrict__ LSE_part,\n"
    "    elem_t* __restrict__ O, float* __restrict__ LSE, long long rows, long long row, int c,\n"
    "    int b, int token, int head, int q_len, int q_heads, int splits, long long o_sb,\n"
    "    long long o_ss, long long o_sh, bool dry) {\n"
    + ONCE_BODY.replace("LOADF(", "__ldcg(").replace("LOAD4(", "__ldcg(")
    + "  if (!dry)\n"
    "    store_quad(O, LSE, acc, total, m, b, token, head, c, q_len, q_heads, o_sb, o_ss, o_sh);\n"
    "}\n")

COMBINE_CALL = ("  combine_quad<false>(O_part, LSE_part, O, LSE, rows, row, c, b, token, head, "
                "q_len, q_heads,\n                      splits, o_sb, o_ss, o_sh);\n}")
WAIT = "  if constexpr (COMBINE_PDL) wait_for_prerequisites();\n"
COMBINE_ENTRY = ("attn_decode_combine(const float* __restrict__ O_part, const float* __restrict__ "
                 "LSE_part,\n                    elem_t* __restrict__ O, float* __restrict__ LSE, "
                 "int batch, int q_len,\n                    int q_heads, int splits, long long "
                 "o_sb, long long o_ss, long long o_sh) {\n  using namespace cfg;\n" + WAIT)
COMBINE_DRY = (  # the whole kernel's body: its index arithmetic before the wait too
    "attn_decode_combine(const float* __restrict__ O_part, const float* __restrict__ LSE_part,\n"
    "                    elem_t* __restrict__ O, float* __restrict__ LSE, int batch, int q_len,\n"
    "                    int q_heads, int splits, long long o_sb, long long o_ss,\n"
    "                    long long o_sh) {\n"
    "  using namespace cfg;\n"
    "  constexpr int ROW_THREADS = HEAD_DIM / 4;\n"
    "  const int gid = blockIdx.x * COMBINE_THREADS + threadIdx.x;\n"
    "  const int row = gid / ROW_THREADS, rows = batch * q_len * q_heads;\n"
    "  if (row >= rows) return;\n"
    "  const int c = (gid % ROW_THREADS) * 4;\n"
    "  const int head = row % q_heads, token = (row / q_heads) % q_len,\n"
    "            b = row / (q_heads * q_len);\n"
    "  if constexpr (COMBINE_PDL)\n"
    "    combine_quad_cold(O_part, LSE_part, O, LSE, rows, row, c, b, token, head, q_len,\n"
    "                      q_heads, splits, o_sb, o_ss, o_sh, true);\n"
    + WAIT +
    "  combine_quad_cold(O_part, LSE_part, O, LSE, rows, row, c, b, token, head, q_len, q_heads,\n"
    "                    splits, o_sb, o_ss, o_sh, false);\n}")
TREE_INDEX = ("  const long long gid = (long long)blockIdx.x * COMBINE_THREADS + threadIdx.x;\n"
              "  const long long row = gid / ROW_THREADS, rows = (long long)batch * q_len * "
              "q_heads;\n")
TREE_INDEX_INT = ("  const int gid = blockIdx.x * COMBINE_THREADS + threadIdx.x;\n"
                  "  const int row = gid / ROW_THREADS, rows = batch * q_len * q_heads;\n")
LAST_SYNC = ("    cluster_sync();  // no block leaves, its shared memory with it, while another "
             "reads it\n")
RELAXED_SYNC = ('    asm volatile("barrier.cluster.arrive.relaxed.aligned;\\n\\t'
                'barrier.cluster.wait.aligned;" ::: "memory");\n')


def patch(src: str, variant: str) -> str:
    def once(s: str, old: str, new: str) -> str:
        if s.count(old) != 1:
            raise SystemExit(f"variants: the template changed: {old[:60]!r} not there once")
        return s.replace(old, new)
    if variant in ("base", "tree"):
        return src
    if variant == "tree-int":
        return once(src, TREE_INDEX, TREE_INDEX_INT)
    if variant in ("once", "dry", "dry+relaxed"):
        head = src.index(QUAD_HEAD)
        end = src.index(QUAD_END, head)
        src = src[:head] + ONCE_QUAD + "\n" + COLD_QUAD + src[end:]
    if variant in ("dry", "dry+relaxed"):
        head = src.index(COMBINE_ENTRY)
        end = src.index(COMBINE_CALL, head) + len(COMBINE_CALL)
        src = src[:head] + COMBINE_DRY + src[end:]
    if variant in ("relaxed", "dry+relaxed"):
        src = once(src, LAST_SYNC, RELAXED_SYNC)
    return src


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--offline", metavar="ARCH", help="compile every variant for ARCH and stop")
    ap.add_argument("--base-templates", type=Path, help="the templates the patches apply to")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:6]))
    ap.add_argument("--workloads", nargs="+", default=WORKLOADS)
    ap.add_argument("--no-trace", action="store_true")
    args = ap.parse_args()
    variants = args.variants

    from evoengine import paths
    from evoengine.compile import compile_source
    from evoengine.problems import workload_from_key
    from evoengine.render import make_candidate, render
    from evoengine.space import SearchSpace

    space = SearchSpace.load(paths.SPACES / "decode.toml").with_untested()
    if args.offline:
        from evoengine.arch import get_arch
        arch = get_arch(args.offline)
    else:
        from evoengine.runtime import gpu_arch
        arch = gpu_arch()
    jobs = []
    for name, p in POINTS.items():
        for paged in (True, False):
            key = WORKLOADS[0] if paged else WORKLOADS[2]
            cand = make_candidate(space, space.complete(dict(BASE, **p)),
                                  workload_from_key(key).problem(), arch)
            src = render(cand, args.base_templates)
            for variant in variants:
                jobs.append((name, paged, variant, cand,
                             patch(render(cand), variant) if variant.startswith("tree")
                             else patch(src, variant)))

    def build(job: tuple):
        name, paged, variant, cand, src = job
        compiled = compile_source(src, arch, cand.defines(arch),
                                  identity=f"{cand.identity}@tail-{variant}",
                                  smem_bytes=cand.smem_bytes)
        if not compiled.ok:
            raise SystemExit(f"{name} {variant}: {compiled.error}")
        return compiled
    with ThreadPoolExecutor(8) as pool:
        built = list(pool.map(build, jobs))
    if args.offline:
        for (name, paged, variant, *_), c in zip(jobs, built, strict=True):
            print(name, "paged" if paged else "contig", variant, "ok", c.registers,
                  "registers,", c.spill_bytes, "spilled")
        return 0

    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location(
        "decode_trace", ROOT / "experiments" / "2026-11-27-decode-timeline" / "trace.py")
    tl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tl)
    from evoengine import measure, provenance
    from evoengine.decode import DecodeKernel
    from evoengine.problems.decode import Decode

    problem = Decode()
    kernels = {(j[0], j[1], j[2]): DecodeKernel(j[3], c) for j, c in zip(jobs, built, strict=True)}
    sources = {(j[0], j[1], j[2]): (j[3], j[4]) for j in jobs}
    rows = []
    for key in args.workloads:
        w = workload_from_key(key)
        paged = w.layout == "paged"
        mine = {(n, v): k for (n, p, v), k in kernels.items() if p == paged}
        for nv, k in mine.items():
            verdict = problem.check(k, w)
            if not verdict.ok:
                raise SystemExit(f"{key} {nv}: {verdict.reason}")
        sets = problem.inputs(w)
        times: dict[tuple[str, str], list[float]] = {nv: [] for nv in mine}
        for _ in range(args.rounds):
            for nv, k in mine.items():
                times[nv].append(measure.time_calls(problem.timed_call(k, w, sets), len(sets),
                                                    graph=True).median_us)
        med = {f"{n} | {v}": statistics.median(t) for (n, v), t in times.items()}
        row = dict(workload=key, points_us=med)
        print(key)
        for name in POINTS:
            base = med[f"{name} | base"]
            print(f"  {name} base {base:7.2f} us " + " ".join(
                f"{v} {base / med[f'{name} | {v}']:.3f}" for v in variants[1:]))
        if key in WORKLOADS[:2] and not args.no_trace:  # one traced launch of each
            traces = {}
            for name, variant in mine:
                cand, src = sources[(name, paged, variant)]
                c = compile_source(tl.traced_source(src), arch, cand.defines(arch),
                                   identity=f"{cand.identity}@tail-{variant}@trace",
                                   smem_bytes=cand.smem_bytes)
                if not c.ok:
                    raise SystemExit(f"trace {name} {variant}: {c.error}")
                tk = DecodeKernel(cand, c)
                s = tl.traced_launch(tk, problem.timed_call(tk, w, sets), len(sets), combine=True)
                traces[f"{name} | {variant}"] = {k_: v_ for k_, v_ in s.items()
                                                 if k_ != "blocks_trace"}
                print(f"    trace {name} {variant}: span {s['span_us']:.1f}, merge+write "
                      f"{s['merge_write_us']:.2f}, combine waits end "
                      f"{s['combine_waited_us'][2]:.1f}, done {s['combine_done_us'][2]:.1f} "
                      f"({s['combine_ends_after_main_us']:.2f} after the main kernel)")
            row["traces"] = traces
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    doc = dict(provenance.header(**provenance.local_device(), method=(
        f"{measure.TIMING}, graph replay of {measure.GRAPH_CALLS} calls; {args.rounds} rounds "
        "interleaved over the points and variants, the median of the rounds'; every kernel "
        "through the criterion first; traces: one launch after warm-up, %globaltimer marks")),
        rows=rows)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
