// Hopper (sm_90a) primitives: mbarriers, TMA tensor loads, wgmma fences and shared-memory
// descriptors, register reallocation and named barriers. Each wraps one PTX instruction or
// one idiom; the namespace says which threads run it (mbar: any thread, tma: one thread,
// wg: all 128 threads of a warpgroup together). Header-free, like common/primitives.cuh.

typedef unsigned long long u64;

// A CUtensorMap built on the host (cuTensorMapEncodeTiled) and passed by value as a
// __grid_constant__ kernel parameter; the TMA engine reads it through its generic address.
struct __align__(64) TmaMap {
  u64 opaque[16];
};
static_assert(sizeof(TmaMap) == 128, "CUtensorMap is 128 bytes");

// ---- mbarriers (shared-memory transaction barriers) ---------------------------------------

namespace mbar {

__device__ __forceinline__ void init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (the TMA engine) before use.
__device__ __forceinline__ void fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Arrives and tells the barrier to also wait for `bytes` of TMA writes to land.
__device__ __forceinline__ void arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ u64 global_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// A wait that lasts this long is a deadlock (a bug): trap, so the launch fails with an error
// instead of hanging the GPU. Real waits are microseconds.
constexpr u64 WATCHDOG_NS = 2000000000ull;

// Waits for the phase of parity `parity` to complete. A fresh barrier counts its (virtual)
// phase before the first as complete, so waiting on parity 1 passes at once. Each try_wait
// may suspend the thread for a while; the clock is read only once the first try failed.
__device__ __forceinline__ void wait(u32 bar, u32 parity) {
  if (try_wait(bar, parity)) return;
  const u64 start = global_ns();
#pragma unroll 1
  while (!try_wait(bar, parity)) {
    if (global_ns() - start > WATCHDOG_NS) asm volatile("trap;\n");
  }
}

}  // namespace mbar

// ---- TMA (bulk tensor copies, global -> shared) -------------------------------------------

namespace tma {

__device__ __forceinline__ void prefetch_map(const TmaMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// Copies the box at coordinates (c0 innermost .. c3) of a rank-4 tensor map into shared
// memory at `dst`; completes `bytes` of transaction on `bar`. Out-of-range elements are zeros.
__device__ __forceinline__ void load_4d(u32 dst, const TmaMap* map, u32 bar, int c0, int c1,
                                        int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// Copies `src` in shared memory to the box at (c0 innermost .. c3) of a rank-4 tensor map, as
// a bulk group of this thread; elements past the tensor's edges are not written.
__device__ __forceinline__ void store_4d(const TmaMap* map, u32 src, int c0, int c1, int c2,
                                         int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
      ::"l"(reinterpret_cast<u64>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// This thread's bulk stores so far form one group.
__device__ __forceinline__ void commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// At most N of this thread's store groups still read shared memory (READ) or run at all.
template <int N, bool READ>
__device__ __forceinline__ void wait_stores() {
  if constexpr (READ) {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
  }
}

__device__ __forceinline__ void load_5d(u32 dst, const TmaMap* map, u32 bar, int c0, int c1,
                                        int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}

}  // namespace tma

// ---- warpgroups -----------------------------------------------------------------------------

namespace wg {

// Orders this thread's earlier register and shared-memory accesses before the next wgmma.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most N committed wgmma groups are still running.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Pins registers written or read by an in-flight wgmma to this point of the program, so the
// compiler moves no ordinary access of them across a commit or wait.
template <int N>
__device__ __forceinline__ void hold(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void hold(u32 (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}

// Register reallocation between warpgroups (sm_90a): the producer gives registers back, the
// consumers take them. Every thread of the warpgroup runs it, in one branch of the role split.
template <int REGS>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

}  // namespace wg

// Named barriers (bar.sync / bar.arrive with a thread count); id 0 is __syncthreads'.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Shared memory written by ordinary stores that the async proxy (wgmma, TMA) touches next.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Four 8x8 16-bit matrices to shared memory; lane i gives the row address of matrix i / 8 and
// r[j] holds matrix j in the mma accumulator layout (row lane/4, columns 2 (lane%4) + {0, 1}).
__device__ __forceinline__ void stmatrix_x4(u32 addr, const u32 (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// ---- swizzled tiles and wgmma shared-memory descriptors -------------------------------------

// A ROWS x COLS tile of 16-bit values as the TMA engine writes it with an SW-byte swizzle
// (SW = 32, 64 or 128): COLS is cut into panels of SW bytes (PANEL values) and each panel is
// ROWS rows of SW bytes. Inside every 8-row atom the 16-byte chunks of a row are permuted:
// address bits [4, 4+log2(SW/16)) ^= bits [7, 7+log2(SW/16)), i.e. CuTe's Swizzle<b,4,3>.
// The tile must start on an atom boundary (8 * SW bytes) so the hardware sees the same
// pattern; then a wgmma descriptor with base offset 0 reads it.
template <int ROWS, int COLS, int SW>
struct SwizzledTile {
  static_assert(SW == 32 || SW == 64 || SW == 128, "TMA and wgmma swizzle widths");
  static constexpr int PANEL = SW / 2;  // 16-bit values per swizzled row
  static constexpr int PANELS = COLS / PANEL;
  static constexpr int PANEL_BYTES = ROWS * SW;
  static constexpr int ATOM_BYTES = 8 * SW;
  static constexpr int BYTES = ROWS * COLS * 2;
  static constexpr u64 MODE = SW == 128 ? 1 : SW == 64 ? 2 : 3;  // descriptor bits 62-63
  static_assert(COLS % PANEL == 0, "whole panels");
  static_assert(ROWS % 8 == 0, "whole 8-row swizzle atoms");

  // Byte offset of (row, col) from the tile start.
  __device__ static __forceinline__ u32 offset(int row, int col) {
    const u32 b = (col / PANEL) * PANEL_BYTES + row * SW + (col % PANEL) * 2;
    return b ^ (((b >> 7) & (SW / 16 - 1)) << 4);
  }

  // The address of (row, c + c0) from `addr`, that of (row, c0), for c a multiple of 16 and
  // c0 < 16. The swizzle xors the chunk bits with row bits only, and the 32-byte steps of c
  // never share a bit with c0's chunk, so a step is an xor inside the panel plus a panel
  // offset: constants once loops are unrolled, so no per-step address is kept in a register.
  __device__ static __forceinline__ u32 col_step(u32 addr, int c) {
    return (addr ^ ((c % PANEL) * 2)) + (c / PANEL) * PANEL_BYTES;
  }
};

// A wgmma matrix descriptor, split in its two 32-bit words. The low word holds the start
// address (bits 0-13, in 16-byte units) and the leading byte offset (bits 16-29); the high
// word the stride byte offset (bits 0-13) and the swizzle mode (bits 30-31). For a given tile
// layout the high word is a constant, so the kernel passes only the low word and the wrapper
// (mma_async) pastes the constant on as an immediate: no 64-bit arithmetic per k-step, and no
// constant rematerialised in a register for each wgmma. Shared addresses are below 2^18 bytes
// (228 KB on sm_90), so the start address needs no mask and sums of offsets never carry out of
// bits 0-13 into the leading offset.
template <class Tile>
struct KMajor {  // Q, K, P: rows are M or N, the reduction runs along the row
  // The leading offset is unused for swizzled K-major layouts (set to 16 bytes); SBO steps
  // 8 rows.
  static constexpr u64 HI = (u64)((Tile::ATOM_BYTES >> 4) | ((u32)Tile::MODE << 30)) << 32;
  // The k16 slice starting at column k sits in one panel, 32 bytes into its swizzled rows:
  // the tile's descriptor plus the slice's offset in 16-byte units, a constant once loops are
  // unrolled.
  __device__ static __forceinline__ u32 lo(u32 tile, int k) {
    return (tile >> 4) + ((16 >> 4) << 16) +
           (((k / Tile::PANEL) * Tile::PANEL_BYTES + (k % Tile::PANEL) * 2) >> 4);
  }
};
template <class Tile>
struct MNMajor {  // V as the B of P.V: rows are the reduction, N runs along the row
  // LBO steps from one panel of N to the next, SBO steps 8 rows of K.
  static constexpr u64 HI = KMajor<Tile>::HI;
  // The slice of rows [k, k + 16).
  __device__ static __forceinline__ u32 lo(u32 tile, int k) {
    return (tile >> 4) + ((u32)(Tile::PANEL_BYTES >> 4) << 16) + ((k * Tile::PANEL * 2) >> 4);
  }
};

// ---- plain shared-memory access by address ------------------------------------------------

__device__ __forceinline__ void st_shared_b32(u32 addr, u32 v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ u32 ld_shared_b32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// One 16-byte store. Written out as a uint4 through a cast pointer, NVVM splits a value that
// came from asm outputs into four 4-byte stores (st.global.u32; 4x the L2 write requests).
__device__ __forceinline__ void st_global_v4(void* ptr, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n"
               :
               : "l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
