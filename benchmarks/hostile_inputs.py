"""Hostile input on a real GPU: attention, attention_varlen and attention_decode over real
kernels refuse bad calls in one line before any launch, and the device is still healthy
after all of them (a launch on bad input would fault or leave a sticky error).

The CPU suite (tests/test_launch.py, the HOSTILE table) proves the same refusals with
launches recorded instead of run; this checks what only a GPU has: real CUDA devices and
pointers, the value checks' reductions on the device, and a fault that a launch would leave.
Then the CLI with a GPU index that does not exist.

    python benchmarks/hostile_inputs.py --out $OUT/hostile_inputs.json

Writes one JSON document: per case, what was raised (type, message, one line or not), and
whether the valid calls after all of them still agree with SDPA. Exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evoengine import launch as sa  # noqa: E402
from evoengine import paths  # noqa: E402
from evoengine.compile import compile_many  # noqa: E402
from evoengine.problems import problem  # noqa: E402
from evoengine.provenance import header, local_device  # noqa: E402
from evoengine.render import make_candidate  # noqa: E402
from evoengine.runtime import gpu_arch  # noqa: E402
from evoengine.space import SearchSpace  # noqa: E402

DEV = "cuda"
F16 = torch.float16
MMA_POINT = dict(BLOCK_M=64, BLOCK_N=64, NUM_WARPS=4, STAGES=2, SWIZZLE="xor", Q_IN_REGS=True,
                 LAZY_RESCALE=False, MIN_BLOCKS=1, PIPELINE="split")
DECODE_POINT = dict(BLOCK_N=64, BLOCK_M=16, NUM_WARPS=4, STAGES=3, VEC_BYTES=16,
                    L2_PREFETCH=256, SPLIT_POLICY="waves", SPLITS=1)


def entries() -> tuple[Any, Any]:
    """attention (and its varlen) and attention_decode over one fp16 d64 kernel each,
    compiled together for this GPU."""
    arch = gpu_arch()
    wanted = [("fwd", "mma", MMA_POINT, {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": False}),
              ("varlen", "mma", MMA_POINT,
               {"HEAD_DIM": 64, "DTYPE": "fp16", "CAUSAL": False, "VARLEN": True}),
              ("decode", "decode", DECODE_POINT, {"HEAD_DIM": 64, "DTYPE": "fp16",
                                                  "PAGED": True})]
    spaces = {family: SearchSpace.load(paths.SPACES / f"{family}.toml")
              for _, family, _, _ in wanted}
    cands = [make_candidate(spaces[family], spaces[family].complete(point), prob, arch)
             for _, family, point, prob in wanted]
    kernels = [problem(kind).load(cand, compiled) for (kind, *_), cand, compiled
               in zip(wanted, cands, compile_many(cands, arch), strict=True)]
    table = [sa.Entry(0, "fp16", 64, False, 512, 512, 1, 8),
             sa.Entry(1, "fp16", 64, False, 512, 512, 1, 8, kind="varlen"),
             sa.Entry(2, "fp16", 64, True, 1, 4096, 1, 8, kind="decode")]
    attention = sa.TunedAttention(kernels, table, namespace="evohostile")
    return attention, sa.TunedDecode(attention.kernels, table)


def z(*shape: int, dtype: torch.dtype = F16, device: str = DEV) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


def ints(*v: int, dtype: torch.dtype = torch.int32, device: str = DEV) -> torch.Tensor:
    return torch.tensor(v, dtype=dtype, device=device)


def misaligned(*shape: int) -> torch.Tensor:
    return torch.zeros(math.prod(shape) + 1, dtype=F16, device=DEV)[1:].view(*shape)


def cases(attention: Any, decode: Any) -> list[tuple[str, Callable[[], Any], type, str]]:
    q, kv = z(2, 8, 128, 64), z(2, 2, 128, 64)
    pq, pkv, cq, ck = z(30, 8, 64), z(40, 2, 64), ints(0, 10, 30), ints(0, 15, 40)
    dq, pages, lens = z(2, 1, 8, 64), z(10, 16, 2, 64), ints(20, 30)
    table = ints(0, 1, 2, 3, 4, 5, 6, 7).view(2, 4)
    f = attention
    v = attention.varlen
    return [
        ("attention rank 3", lambda: f(q[0], kv, kv), ValueError, "4-D"),
        ("attention float32", lambda: f(q.float(), kv.float(), kv.float()), ValueError,
         "float16 or bfloat16"),
        ("attention mixed dtypes", lambda: f(q, kv.bfloat16(), kv), ValueError, "share a dtype"),
        ("attention cpu k", lambda: f(q, kv.cpu(), kv), ValueError, "k must be a CUDA tensor"),
        ("attention GQA 8/3", lambda: f(q, z(2, 3, 128, 64), z(2, 3, 128, 64)), ValueError,
         "multiple of key/value heads"),
        ("attention head_dim 4", lambda: f(z(1, 2, 16, 4), z(1, 2, 16, 4), z(1, 2, 16, 4)),
         ValueError, "head_dim (4) must be a multiple of 8"),
        ("attention head_dim 512", lambda: f(z(1, 2, 16, 512), z(1, 2, 16, 512),
                                             z(1, 2, 16, 512)), sa.NoKernelError, "head_dim 512"),
        ("attention batch 0", lambda: f(z(0, 8, 128, 64), z(0, 2, 128, 64), z(0, 2, 128, 64)),
         ValueError, "q is empty"),
        ("attention last dim strided", lambda: f(z(2, 8, 128, 128)[..., ::2], kv, kv),
         ValueError, "contiguous last dim"),
        ("attention misaligned", lambda: f(misaligned(2, 8, 128, 64), kv, kv), ValueError,
         "16-byte aligned"),
        ("attention scale nan", lambda: f(q, kv, kv, scale=math.nan), ValueError, "finite"),
        ("attention scale str", lambda: f(q, kv, kv, scale="0.1"), TypeError, "scale"),
        ("attention causal str", lambda: f(q, kv, kv, causal="no"), TypeError, "causal"),
        ("attention causal str, grad", lambda: f(q.clone().requires_grad_(), kv, kv,
                                                 causal="no"), TypeError, "causal"),
        ("forward lse alone, fp16", lambda: f.forward(q, kv, kv, lse=z(2, 8, 128)), ValueError,
         "lse must be a contiguous float32"),
        ("forward lse alone, small", lambda: f.forward(q, kv, kv, lse=torch.empty(
            4, dtype=torch.float32, device=DEV)), ValueError, "lse must be"),
        ("varlen cu int64", lambda: v(pq, pkv, pkv, cq.long(), ck, 20, 25), ValueError, "int32"),
        ("varlen cu on cpu", lambda: v(pq, pkv, pkv, cq.cpu(), ck, 20, 25), ValueError,
         "must be on"),
        ("varlen cu decreasing", lambda: v(pq, pkv, pkv, ints(0, 20, 10, 30),
                                           ints(0, 15, 15, 40), 20, 25), ValueError,
         "never decrease"),
        ("varlen cu past the tensor", lambda: v(pq, pkv, pkv, cq, ints(0, 15, 99), 20, 99),
         ValueError, "end at the packed length 40"),
        ("varlen max_seqlen too small", lambda: v(pq, pkv, pkv, cq, ck, 19, 25), ValueError,
         "smaller than a sequence"),
        ("varlen max_seqlen 2**31", lambda: v(pq, pkv, pkv, cq, ck, 2**31, 25), ValueError,
         "2**31"),
        ("varlen heads 0", lambda: v(z(30, 0, 64), pkv, pkv, cq, ck, 20, 25), ValueError,
         "heads >= 1"),
        ("varlen causal str", lambda: v(pq, pkv, pkv, cq, ck, 20, 25, causal="no"), TypeError,
         "causal"),
        ("decode table out of range", lambda: decode(dq, pages, pages, lens, ints(
            0, 1, 2, 3, 4, 10, 6, 7).view(2, 4)), ValueError, "block_table entries"),
        ("decode table negative", lambda: decode(dq, pages, pages, lens, ints(
            0, -1, 2, 3, 4, 5, 6, 7).view(2, 4)), ValueError, "block_table entries"),
        ("decode length past the cache", lambda: decode(dq, pages, pages, ints(20, 65), table),
         ValueError, "cache_seqlens must lie in"),
        ("decode q_len 17", lambda: decode(z(2, 17, 8, 64), pages, pages, lens, table),
         ValueError, "q_len must be at most 16"),
        ("decode page size 12", lambda: decode(dq, z(10, 12, 2, 64), z(10, 12, 2, 64), lens,
                                               table), ValueError, "power of 2"),
        ("decode lens on cpu", lambda: decode(dq, pages, pages, lens.cpu(), table), ValueError,
         "one CUDA device"),
        ("decode causal str", lambda: decode(dq, pages, pages, lens, table, causal="no"),
         TypeError, "causal"),
    ]


def valid_calls(attention: Any, decode: Any) -> list[dict[str, Any]]:
    """One good call per entry after all the refusals, against SDPA: the device is healthy."""
    torch.manual_seed(0)
    out: list[dict[str, Any]] = []
    q, k = z(2, 8, 300, 64), z(2, 2, 300, 64)
    got = attention(q, k, k)
    ref = sa.sdpa_attention(q, k, k, causal=False)
    out.append({"entry": "attention", "max_abs_err": float((got - ref).abs().max())})
    pq, pk = z(30, 8, 64), z(40, 2, 64)
    cq, ck = ints(0, 10, 30), ints(0, 15, 40)
    got = attention.varlen(pq, pk, pk, cq, ck, 20, 25)
    ref = sa.varlen.varlen_sdpa(pq, pk, pk, cq, ck, causal=False)
    out.append({"entry": "attention_varlen", "max_abs_err": float((got - ref).abs().max())})
    dq, pages = z(2, 1, 8, 64), z(10, 16, 2, 64)
    lens, table = ints(20, 30), ints(0, 1, 2, 3, 4, 5, 6, 7).view(2, 4)
    got = decode(dq, pages, pages, lens, table)
    ref = sa.sdpa_decode(dq, pages, pages, lens, table)
    out.append({"entry": "attention_decode", "max_abs_err": float((got - ref).abs().max())})
    got32 = attention.varlen(pq.float(), pk.float(), pk.float(), cq, ck, 20, 25,
                             fallback="sdpa")  # float32 through the fallback (was refused)
    ref = sa.varlen.varlen_sdpa(pq, pk, pk, cq, ck, causal=False)
    out.append({"entry": "attention_varlen float32 fallback",
                "max_abs_err": float((got32 - ref.float()).abs().max())})
    torch.cuda.synchronize()
    return out


def cli_cases() -> list[dict[str, Any]]:
    """The CLI with a GPU index this machine does not have: one line, exit 2."""
    results = []
    missing = str(torch.cuda.device_count() + 3)
    for args, limit in ((["search", "--shape", "1,8,256,64", "--trials", "1", "--device",
                          missing], 60),
                        (["tune", "--q-heads", "8", "--head-dim", "64", "--trials", "1",
                          "--device", missing, "-o", "/tmp/evo-hostile.py"], 30)):
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "evoengine", *args,
                                   "--store", "/tmp/evo-hostile.db"], cwd=ROOT, text=True,
                                  capture_output=True, timeout=limit)
            err = done.stderr.strip().splitlines()
            # one line: the error is stderr's last, and nothing of CUDA's advice follows it
            results.append({"args": args, "rc": done.returncode, "stderr_tail": err[-3:],
                            "ok": (done.returncode == 2 and "Traceback" not in done.stderr
                                   and bool(err) and err[-1].startswith("evoengine: ")
                                   and "CUDA_LAUNCH_BLOCKING" not in done.stderr),
                            "seconds": round(time.perf_counter() - start, 1)})
        except subprocess.TimeoutExpired:
            results.append({"args": args, "ok": False, "why": f"timed out after {limit} s"})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="hostile_inputs.json")
    parser.add_argument("--no-cli", action="store_true", help="skip the CLI cases")
    args = parser.parse_args()
    start = time.perf_counter()
    attention, decode = entries()
    rows = []
    for name, call, error, message in cases(attention, decode):
        row: dict[str, Any] = {"case": name, "expected": f"{error.__name__}: ...{message}..."}
        try:
            call()
            row.update(ok=False, raised=None)
        except Exception as e:  # noqa: BLE001 - what was raised is the result
            text = str(e)
            row.update(raised=type(e).__name__, message=text,
                       ok=type(e) is error and message in text and "\n" not in text)
        rows.append(row)
    healthy = valid_calls(attention, decode)
    cli = [] if args.no_cli else cli_cases()
    failed = ([r["case"] for r in rows if not r["ok"]]
              + [h["entry"] for h in healthy if not h["max_abs_err"] < 2e-2]
              + [" ".join(c["args"][:1]) for c in cli if not c["ok"]])
    refused = len(rows) - sum(not r["ok"] for r in rows)
    doc = header(**local_device(), method="each hostile call once on real CUDA tensors, what it "
                 "raised recorded; then valid calls compared with SDPA; then the CLI",
                 summary=f"{refused}/{len(rows)} refused as expected in one line; "
                 f"failed: {', '.join(failed) or 'none'}",
                 cases=rows, valid_after=healthy, cli=cli, failed=failed,
                 seconds=round(time.perf_counter() - start, 1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{refused}/{len(rows)} refused as expected; "
          f"valid calls after: {[round(h['max_abs_err'], 4) for h in healthy]}; "
          f"CLI: {[c.get('rc') for c in cli]}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
