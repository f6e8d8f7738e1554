"""Where a block's dynamic shared memory starts, with and without a thread block cluster.

A wgmma descriptor holds 18 bits of shared address. This prints the shared-window address of
the first dynamic byte of each block: on the H200 (2026-11-28) 0x400 without a cluster, and
0x400 / 0x1000400 for ranks 0 / 1 of a cluster of 2, the rank above bit 24 (docs/NOTES.md,
"decode's S and P.V on wgmma").

    python experiments/2026-11-28-decode-wgmma/smem_base.py
"""

import cupy as cp

BODY = r"""
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned a;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
               : "=r"(a) : "l"(smem));
  if (threadIdx.x == 0) out[blockIdx.x] = a;
"""
SOURCE = (
    'extern "C" __global__ void __cluster_dims__(2, 1, 1) with_cluster(unsigned* out) {'
    + BODY + "}\n"
    + 'extern "C" __global__ void without(unsigned* out) {' + BODY + "}\n"
)


def main() -> None:
    module = cp.RawModule(code=SOURCE, options=("-arch=sm_90a",))
    for name in ("with_cluster", "without"):
        kernel = module.get_function(name)
        kernel.max_dynamic_shared_size_bytes = 100000
        out = cp.zeros(4, dtype=cp.uint32)
        kernel((4,), (128,), (out,), shared_mem=100000)
        print(name, [hex(int(x)) for x in out.get()])


if __name__ == "__main__":
    main()
