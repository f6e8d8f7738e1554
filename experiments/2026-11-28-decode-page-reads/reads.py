"""Does the shape of a block's reads decide what a shuffled page table costs? (issue #18)

    python experiments/2026-11-28-decode-page-reads/reads.py --out reads.json

No attention: a kernel that only reads a paged K/V cache (vLLM layout [pages, 64, 8, 128],
fp16, 128 KB a page) and XORs what it read. Each block reads HB of the 8 KV heads over a run
of tokens of one sequence, through that sequence's block table:
- HB 1: 256 contiguous bytes a token (one head: what decode's blocks read today);
- HB 2: 512 bytes a token;
- HB 8: the whole 2 KB token row, so a block reads each of its pages end to end.
Every variant reads the same bytes with the same number of blocks (the sequence's work cut
into NB pieces), 256 threads, 2 x --unroll loads of 16 bytes in flight a thread. Block tables:
identity (sequence b owns pages b*P.. in order: a contiguous cache) and shuffled (a random
permutation of all pages). Next to them a device copy of the same bytes. The question: is
the shuffle's 1-3% (2026-11-27-h100-decode-page-order.json) a property of 256-byte reads
spread over 8 blocks a page, which whole-page blocks would not pay?
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SRC = r"""
extern "C" __global__ void __launch_bounds__(256)
reads(const uint4* __restrict__ k, const uint4* __restrict__ v, const int* __restrict__ table,
      int pages_per_seq, int tokens_per_block, int groups, int split_fast, unsigned* out)
{
    // HB heads a block: HB * 16 uint4 a token; 256 / (HB * 16) tokens an iteration.
    const int chunk = HB * 16;
    const int tpi = 256 / chunk;
    const int lane = threadIdx.x % chunk;
    const int tok0 = threadIdx.x / chunk;
    const int nsplit = gridDim.x / groups;
    const int g = split_fast ? blockIdx.x / nsplit : blockIdx.x % groups;
    const int s = split_fast ? blockIdx.x % nsplit : blockIdx.x / groups;
    const int b = blockIdx.y;
    const int* tab = table + (long long)b * pages_per_seq;
    unsigned acc = 0;
    const int first = s * tokens_per_block;
    for (int it = 0; it < tokens_per_block; it += U * tpi) {
        uint4 kk[U], vv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = first + it + u * tpi + tok0;
            const long long page = tab[j >> 6];
            const long long off = page * 8192 + (j & 63) * 128 + g * chunk + lane;
            kk[u] = __ldg(k + off);
            vv[u] = __ldg(v + off);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            acc ^= kk[u].x ^ kk[u].y ^ kk[u].z ^ kk[u].w ^ vv[u].x ^ vv[u].y ^ vv[u].z ^ vv[u].w;
    }
    atomicXor(out + blockIdx.y * gridDim.x + blockIdx.x, acc);
}
"""

# --ring STAGES: the reads as decode's ring makes them. Each block streams tiles of 128 / HB
# tokens (32 KB of K and 32 KB of V whatever HB) through a STAGES-deep cp.async ring in dynamic
# shared memory, 128 threads, the slot of tile t - 1 refilled after the barrier of tile t, and
# XORs every tile out of shared memory (one pass over it, as decode's ldmatrix reads do).
RING_SRC = r"""
constexpr int THREADS = 128;
constexpr int TOK = 128 / HB;          // tokens a tile
constexpr int CHUNK = HB * 16;         // uint4 of a token's HB heads
constexpr int TILE = TOK * CHUNK;      // uint4 of K (and of V) a tile: 2048
__device__ __forceinline__ void cp16(const void* dst, const void* src) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src));
}
extern "C" __global__ void __launch_bounds__(THREADS)
reads(const uint4* __restrict__ k, const uint4* __restrict__ v, const int* __restrict__ table,
      int pages_per_seq, int tokens_per_block, int groups, int split_fast, unsigned* out)
{
    extern __shared__ uint4 ring[];
    const int nsplit = gridDim.x / groups;
    const int g = split_fast ? blockIdx.x / nsplit : blockIdx.x % groups;
    const int s = split_fast ? blockIdx.x % nsplit : blockIdx.x / groups;
    const int* tab = table + (long long)blockIdx.y * pages_per_seq;
    const int first = s * tokens_per_block, n_tiles = tokens_per_block / TOK;
    auto issue = [&](int t, int slot) {
        uint4* dk = ring + slot * 2 * TILE;
        for (int i = threadIdx.x; i < TILE; i += THREADS) {
            const int j = first + t * TOK + i / CHUNK;
            const long long off = (long long)tab[j >> 6] * 8192 + (j & 63) * 128 + g * CHUNK
                                  + i % CHUNK;
            cp16(dk + i, k + off);
            cp16(dk + TILE + i, v + off);
        }
    };
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < n_tiles) issue(t, t);
        asm volatile("cp.async.commit_group;");
    }
    unsigned acc = 0;
    for (int t = 0; t < n_tiles; ++t) {
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2));
        __syncthreads();
        if (t + STAGES - 1 < n_tiles) issue(t + STAGES - 1, (t + STAGES - 1) % STAGES);
        asm volatile("cp.async.commit_group;");
        const uint4* sk = ring + (t % STAGES) * 2 * TILE;
        for (int i = threadIdx.x; i < 2 * TILE; i += THREADS) {
            const uint4 x = sk[i];
            acc ^= x.x ^ x.y ^ x.z ^ x.w;
        }
    }
    atomicXor(out + blockIdx.y * gridDim.x + blockIdx.x, acc);
}
"""


def ring_bytes(args) -> int:
    """Dynamic shared memory of the ring kernel: STAGES tiles of 32 KB of K and 32 KB of V."""
    return args.ring * 64 * 1024


def run_batch(batch, args, fns):
    """The variants' rows for one batch, all timed in turn over the same cache."""
    import cupy as cp
    import numpy as np
    import torch

    from evoengine import measure

    dev = torch.device("cuda")
    rows = []
    P = args.cache // 64
    pages = batch * P
    k = torch.randn(pages, 64, 8, 128, device=dev, dtype=torch.float16)
    v = torch.randn_like(k)
    nbytes = 2 * k.numel() * 2
    gen = torch.Generator().manual_seed(0)
    tables = {"identity": torch.arange(pages, dtype=torch.int32).view(batch, P),
              "shuffled": torch.randperm(pages, generator=gen).to(torch.int32).view(batch, P)}
    tables = {n: t.to(dev) for n, t in tables.items()}
    dst = torch.empty_like(k)
    variants = []
    for nb in args.blocks:
        for hb in (1, 2, 8):
            groups = 8 // hb
            splits = nb // groups
            tpb = args.cache // splits
            for order in (("heads_fast", "splits_fast") if hb < 8 else ("heads_fast",)):
                for tname in tables:
                    variants.append((nb, hb, groups, splits, tpb, order, tname))
    out = cp.empty(max(var[0] for var in variants) * batch, dtype=cp.uint32)
    # Each variant's launch arguments, built once: the timed call is the launch alone.
    launches = {var: ((var[0], batch), (128 if args.ring else 256,),
                      (cp.asarray(k), cp.asarray(v), cp.asarray(tables[var[6]]), cp.int32(P),
                       cp.int32(var[4]), cp.int32(var[2]), cp.int32(var[5] == "splits_fast"),
                       out))
                for var in variants}

    def launch(var):
        fns[var[1]](*launches[var], shared_mem=ring_bytes(args))

    def copy():
        dst.copy_(k)
        dst.copy_(v)

    def timed(fn):
        return measure.time_calls(lambda _i: fn(), 1, graph=False).median_us

    # Correctness of the addressing: every variant XORs the same bytes, and at batch 1 the
    # host's XOR of the whole cache.
    torch.cuda.synchronize()
    want = None
    if batch == 1:
        words = np.concatenate([k.view(torch.int32).cpu().numpy().ravel(),
                                v.view(torch.int32).cpu().numpy().ravel()])
        want = int(np.bitwise_xor.reduce(words.view(np.uint32)))
    xors = {}
    for var in variants:
        out.fill(0)
        launch(var)
        torch.cuda.synchronize()
        xors[var] = int(np.bitwise_xor.reduce(cp.asnumpy(out[: var[0] * batch])))
    if len(set(xors.values())) != 1 or (want is not None and want not in xors.values()):
        raise SystemExit(f"batch {batch}: the variants read different bytes: host {want}, "
                         + ", ".join(f"{var[:2] + var[5:]}={x}" for var, x in xors.items()))
    times = {var: [] for var in variants}
    copies = []
    for _ in range(args.rounds):
        copies.append(timed(copy))
        for var in variants:
            times[var].append(timed(functools.partial(launch, var)))
    copy_us = statistics.median(copies)
    print(f"batch {batch}: {nbytes / 1e9:.2f} GB of K and V; copy {copy_us:.1f} us "
          f"({2 * nbytes / copy_us / 1e6:.0f} GB/s read + written)")
    print(f"{'blocks':>6} {'heads':>5} {'order':>12} {'table':>9} {'us':>9} {'GB/s':>6}")
    for var in variants:
        t = statistics.median(times[var])
        nb, hb, groups, splits, tpb, order, tname = var
        print(f"{nb:>6} {hb:>5} {order:>12} {tname:>9} {t:9.1f} {nbytes / t / 1e3:6.0f}")
        rows.append(dict(unroll=args.unroll, ring=args.ring, batch=batch, cache_len=args.cache,
                         blocks_a_sequence=nb, heads_a_block=hb, splits=splits, order=order,
                         table=tname, us=t, rounds_us=times[var], read_gbps=nbytes / t / 1e3,
                         copy_us=copy_us))
    return rows


def main() -> None:
    import cupy as cp
    import torch

    from evoengine import measure
    from evoengine.provenance import header, local_device

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--cache", type=int, default=32768)
    ap.add_argument("--unroll", type=int, default=4,
                    help="iterations a thread has in flight (each a 16-byte load of K and of V)")
    ap.add_argument("--ring", type=int, default=0, metavar="STAGES",
                    help="read through a cp.async ring of STAGES 64 KB tiles (0: plain loads)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[128, 256],
                    help="blocks a sequence (NB)")
    args = ap.parse_args()

    opts = ("-std=c++17", f"-DU={args.unroll}", f"-DSTAGES={args.ring}")
    mods = {hb: cp.RawModule(code=RING_SRC if args.ring else SRC, options=(*opts, f"-DHB={hb}"))
            for hb in (1, 2, 8)}
    fns = {hb: m.get_function("reads") for hb, m in mods.items()}
    for fn in fns.values():
        fn.max_dynamic_shared_size_bytes = ring_bytes(args)
    rows = []
    for batch in args.batch:
        rows += run_batch(batch, args, fns)
        torch.cuda.empty_cache()
    method = (f"{measure.TIMING}, {args.rounds} rounds interleaved, "
              "median of the rounds' medians; no input rotation (the smallest set, batch 1, is "
              "134 MB against 50 MB of L2)")
    head = header(**local_device(), method=method)
    args.out.write_text(json.dumps({**head, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
