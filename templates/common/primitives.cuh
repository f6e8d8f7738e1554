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

// The two 16-bit values of one register as floats (exact), `lo` from the low half.
template <bool BF16>
__device__ __forceinline__ void unpack2(u32 v, float& lo, float& hi) {
  if constexpr (BF16) {
    lo = __uint_as_float(v << 16);
    hi = __uint_as_float(v & 0xffff0000u);
  } else {
    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
        : "=f"(lo), "=f"(hi)
        : "r"(v));
  }
}

// A 32-bit store to a shared-memory byte address.
__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// *addr += x in global memory, atomically, without reading the old value back.
__device__ __forceinline__ void red_add(float* addr, float x) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(addr), "f"(x) : "memory");
}

// ---- mma.sync m16n8k16 and its fragments (sm_80+) -------------------------------------------

template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Per-lane ldmatrix addresses, computed once; fragments are then reached with Tile::step.
// A (16x16, row-major) at rows [0,16), cols [0,16) of a row-major tile.
template <class Tile>
__device__ __forceinline__ int a_lane_offset(int lane) {
  return Tile::offset(lane & 15, (lane >> 4) * 8);
}
// B of two n8 tiles (n 0..15, k 0..15) from K stored [n][k]: b[0..1] for n 0..7, b[2..3] for 8..15.
// Through ldmatrix.trans the same addresses give the A (16x16, m x k) of a tile stored [k][m].
template <class Tile>
__device__ __forceinline__ int kt_lane_offset(int lane) {
  return Tile::offset((lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8);
}
// B of two n8 tiles (k 0..15, n 0..15) from V stored [k][n], through ldmatrix.trans. Steps
// from any of these lane addresses need column steps that are multiples of 16 (the lane's own
// column is 0 or 8; see SmemTile::step).
template <class Tile>
__device__ __forceinline__ int v_lane_offset(int lane) {
  return Tile::offset((lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 8);
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
  // step's bits never overlap; from a column in chunk 0, any multiple of 8). Once loops are unrolled dr and dc are constants and a step
  // is an xor and an immediate add, so no per-step address is kept in a register. The xor
  // comes first: it touches only the bits below GROUP * 16 bytes and the add only those above
  // (rows are whole swizzle groups), so every step with the same column chunk shares one xor
  // and the row steps fold into the load's immediate offset. Needs the tile to start on a
  // 128-byte boundary.
  __device__ static __forceinline__ u32 step(u32 addr, int dr, int dc) {
    const int dchunk = dc >> 3;
    if constexpr (GROUP > 1) {
      static_assert(ROW_BYTES % (GROUP * 16) == 0, "a row is whole swizzle groups");
      return (addr ^ ((dchunk % GROUP) * 16)) + dr * ROW_BYTES + (dchunk / GROUP) * GROUP * 16;
    } else {
      return addr + dr * ROW_BYTES + dchunk * 16;
    }
  }
};

// A compile-time bool as a value, to pick a variant of a generic lambda's body.
template <bool B>
struct Bool {
  static constexpr bool value = B;
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

// Streams consecutive ROWS-row tiles of a row-major global matrix (K or V) into shared-memory
// tiles, one tile per load(). Each thread copies the same (row, chunk) slots of every tile, so
// its global pointer and shared offset are computed once and a load is a pointer bump plus
// immediate offsets. Rows at or past `rows_valid` become zeros; only a tile that has such rows
// (the key tail) pays for the per-row checks.
template <class Tile, int ROWS, int THREADS>
struct TileStream {
  static constexpr bool ONE_COLUMN = THREADS % Tile::CHUNKS == 0;  // each thread keeps a column
  static constexpr int ROW_STEP = ONE_COLUMN ? THREADS / Tile::CHUNKS : 1;
  // Row steps that keep the swizzle phase reach the next slot with an immediate offset.
  static constexpr bool IMMEDIATE = ROW_STEP % Tile::GROUP == 0;

  const elem_t* next;  // ONE_COLUMN: this thread's first chunk of the next tile; else its row 0
  long long stride;    // elements between rows
  int first;           // ONE_COLUMN: this thread's first row of a tile; else its thread index
  u32 dst;             // ONE_COLUMN: byte offset of that row's chunk in the shared tile

  __device__ __forceinline__ TileStream(const elem_t* src, long long row_stride, int tid)
      : next(src), stride(row_stride), first(tid), dst(0) {
    if constexpr (ONE_COLUMN) {
      first = tid / Tile::CHUNKS;
      const int col = (tid % Tile::CHUNKS) * 8;
      next += first * row_stride + col;
      dst = Tile::offset(first, col) * 2;
    }
  }

  // Copies the next tile to the shared tile at byte address `tile`, then moves on by ROWS rows.
  __device__ __forceinline__ void load(u32 tile, int rows_valid) {
    if (rows_valid >= ROWS) {
      copy<false>(tile, rows_valid);
    } else {
      copy<true>(tile, rows_valid);
    }
    next += ROWS * stride;
  }

 private:
  template <bool BOUNDED>
  __device__ __forceinline__ void copy(u32 tile, int rows_valid) {
    if constexpr (ONE_COLUMN) {
      const elem_t* from = next;
      const elem_t* safe = next - first * stride;  // the tile's first row: always a real row
#pragma unroll
      for (int i = 0; i < (ROWS + ROW_STEP - 1) / ROW_STEP; ++i) {
        const int row = first + i * ROW_STEP;
        if (ROWS % ROW_STEP == 0 || row < ROWS) {
          const u32 to = IMMEDIATE ? tile + dst + i * ROW_STEP * Tile::ROW_BYTES
                                   : tile + Tile::offset(row, (threadIdx.x % Tile::CHUNKS) * 8) * 2;
          const bool valid = !BOUNDED || row < rows_valid;
          cp_async_16(to, valid ? from : safe, valid);
        }
        from += ROW_STEP * stride;
      }
    } else {
      constexpr int CHUNKS = ROWS * Tile::CHUNKS;
#pragma unroll
      for (int i = 0; i < (CHUNKS + THREADS - 1) / THREADS; ++i) {
        const int c = first + i * THREADS;
        if (CHUNKS % THREADS == 0 || c < CHUNKS) {
          const int row = c / Tile::CHUNKS, col = (c % Tile::CHUNKS) * 8;
          const bool valid = !BOUNDED || row < rows_valid;
          cp_async_16(tile + Tile::offset(row, col) * 2, valid ? next + row * stride + col : next,
                      valid);
        }
      }
    }
  }
};
