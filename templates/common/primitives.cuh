// Small named device primitives shared by the attention families. Each wraps one PTX
// instruction or one idiom, so the kernels read as the algorithm. Header-free: tensors are
// raw 16-bit storage and every conversion goes through PTX, so NVRTC needs no CUDA headers.

typedef unsigned short elem_t;  // one fp16 or bf16 value, as stored
typedef unsigned int u32;

enum Swizzle : int { SWIZZLE_NONE = 0, SWIZZLE_PAD = 1, SWIZZLE_XOR = 2 };

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 addr;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(p));
  return addr;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

__device__ __forceinline__ float fast_exp2(float x) {  // exp2(-inf) == +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two floats rounded to one 32-bit register of two 16-bit values, `lo` in the low half.
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if constexpr (BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// ---- asynchronous global -> shared copies (sm_80+) ----------------------------------------

// Copies 16 bytes, or writes 16 zero bytes when `valid` is false (src is then not read).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- shared-memory tiles --------------------------------------------------------------------

// A ROWS x COLS tile of 16-bit values in shared memory, in 16-byte chunks of 8 values.
// PAD adds one chunk per row; XOR permutes a row's chunks by its row index, so the 8 rows an
// ldmatrix or a column read touches fall in different banks.
template <int ROWS, int COLS, int SWZ>
struct SmemTile {
  static_assert(COLS % 8 == 0, "rows are whole 16-byte chunks");
  static constexpr int CHUNKS = COLS / 8;
  static constexpr int GROUP = SWZ != SWIZZLE_XOR ? 1
                               : CHUNKS % 8 == 0  ? 8
                               : CHUNKS % 4 == 0  ? 4
                               : CHUNKS % 2 == 0  ? 2
                                                  : 1;
  static constexpr int LD = COLS + (SWZ == SWIZZLE_PAD ? 8 : 0);
  static constexpr int ROW_BYTES = LD * 2;
  static constexpr int ELEMS = ROWS * LD;
  static constexpr int BYTES = ELEMS * 2;

  // Element offset of (row, col).
  __device__ static __forceinline__ int offset(int row, int col) {
    int chunk = col >> 3;
    if constexpr (GROUP > 1) chunk ^= row & (GROUP - 1);
    return row * LD + (chunk << 3) + (col & 7);
  }

  // The byte address of (row + dr, col + dc) from the shared-memory byte address of (row, col),
  // with dr a multiple of 8 and dc a multiple of 16 (so the lane's own chunk bits and the
  // step's bits never overlap). Once loops are unrolled dr and dc are constants and a step
  // is an immediate add or xor, so no per-step address is kept in a register. Needs the tile
  // to start on a 128-byte boundary.
  __device__ static __forceinline__ u32 step(u32 addr, int dr, int dc) {
    const int dchunk = dc >> 3;
    if constexpr (GROUP > 1) {
      return ((addr + dr * ROW_BYTES) ^ ((dchunk % GROUP) * 16)) + (dchunk / GROUP) * GROUP * 16;
    } else {
      return addr + dr * ROW_BYTES + dchunk * 16;
    }
  }
};

// All THREADS threads copy rows [0, ROWS) of a global tile into `tile`; rows at or past
// `rows_valid` become zeros, so out-of-range keys and values contribute nothing (never NaN).
template <class Tile, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_async(elem_t* tile, const elem_t* src, long long row_stride,
                                                int rows_valid, int tid) {
  constexpr int CHUNKS = ROWS * Tile::CHUNKS;
  if constexpr (THREADS % Tile::CHUNKS == 0) {
    // Each thread keeps one column and walks down the rows: one address, stepped.
    constexpr int ROW_STEP = THREADS / Tile::CHUNKS;
    const int row0 = tid / Tile::CHUNKS, col = (tid % Tile::CHUNKS) * 8;
    const elem_t* from = src + row0 * row_stride + col;
    const long long from_step = ROW_STEP * row_stride;
#pragma unroll
    for (int i = 0; i < (ROWS + ROW_STEP - 1) / ROW_STEP; ++i) {
      const int row = row0 + i * ROW_STEP;
      if (ROWS % ROW_STEP == 0 || row < ROWS) {
        const bool valid = row < rows_valid;
        cp_async_16(smem_addr(tile + Tile::offset(row, col)), valid ? from : src, valid);
      }
      from += from_step;
    }
  } else {
#pragma unroll
    for (int i = 0; i < (CHUNKS + THREADS - 1) / THREADS; ++i) {
      const int c = tid + i * THREADS;
      if (CHUNKS % THREADS == 0 || c < CHUNKS) {
        const int row = c / Tile::CHUNKS;
        const int col = (c % Tile::CHUNKS) * 8;
        const bool valid = row < rows_valid;
        const elem_t* from = valid ? src + row * row_stride + col : src;
        cp_async_16(smem_addr(tile + Tile::offset(row, col)), from, valid);
      }
    }
  }
}
