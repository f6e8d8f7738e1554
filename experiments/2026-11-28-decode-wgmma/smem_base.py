import cupy as cp
src = r'''
extern "C" __global__ void __cluster_dims__(2,1,1) with_cluster(unsigned* out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned a; asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(smem));
  if (threadIdx.x == 0) out[blockIdx.x] = a;
}
extern "C" __global__ void without(unsigned* out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned a; asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(smem));
  if (threadIdx.x == 0) out[blockIdx.x] = a;
}
'''
m = cp.RawModule(code=src, options=("-arch=sm_90a",))
for name in ("with_cluster", "without"):
    f = m.get_function(name)
    f.max_dynamic_shared_size_bytes = 100000
    out = cp.zeros(4, dtype=cp.uint32)
    f((4,), (128,), (out,), shared_mem=100000)
    print(name, [hex(int(x)) for x in out.get()])
