// The first and last kernels of a backward pass, shared by the backward families (one source,
// so that every family's cubin launches them the same way: evoengine/backward.py), and the
// query blocks a key block visits. Included after the family's namespace cfg, which must
// define HEAD_DIM, IS_BF16, CAUSAL, BLOCK_M (query rows per step: the padding of the per-row
// values), BLOCK_N (keys per main-kernel block: the parts of dQ in deterministic mode) and
// DQACC_FRAGMENT (dQacc in the wgmma family's fragment order: its DQ_LAYOUT) and
// DQACC_TRANSPOSED (that order of its transposed dQ GEMM, DQ_TRANSPOSED); the parts of
// deterministic mode are always in row order; and GROUP_SPLIT (the blocks a key/value head's
// group of query heads is dealt to: first_head, heads_here, and attn_bwd_kv_post's shares).
//   attn_bwd_pre:  delta = rowsum(dO * O) and the log-sum-exp in the log2 domain, per query row,
//                  padded to whole query blocks; zeroes the fp32 dQ accumulator when atomics
//                  build it.
//   attn_bwd_post: dQ fp32 -> fp16/bf16, scaled (summing the per-key-block parts if stored).
// Ragged batches (a family's VARLEN, problem kind varlen_bwd): every kernel also takes
// cu_seqlens_q, cu_seqlens_k and total_q, and batch index b is the sequence of query rows
// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and of key rows alike (varlen_seq); the packed
// tensors come with batch strides of 0. The forward's log-sum-exp and the fp32 dQ buffers are
// [heads, total_q] rows (the varlen forward's log-sum-exp layout); LSE2 and DELTA are
// [heads, seq_q_pad] with each sequence's rows padded to whole query blocks from its own
// first row (Seq::pad0), so seq_q_pad is then that stride, not a length.

namespace cfg {
// The other two kernels: 8 lanes per row in the first, one 8-value chunk per thread in the last.
constexpr int PRE_THREADS = 256;
constexpr int PRE_ROWS = PRE_THREADS / 8;
constexpr int POST_THREADS = 256;
constexpr float LOG2E = 1.4426950408889634f;
}  // namespace cfg

// One sequence of a ragged batch: its first query and key rows in the packed tensors, its
// lengths, and its first row in LSE2 and DELTA. pad0 = (q0 rounded down to 4) + b (BLOCK_M +
// 4): a multiple of 4 (16-byte copies of the per-row values), and sequence b's padded rows
// [pad0, pad0 + round_up(seq_q, BLOCK_M)) end before sequence b + 1's start, so a stride of
// total_q + batch (BLOCK_M + 4), rounded up to 4, holds every head's (the launcher's
// seq_q_pad).
struct Seq {
  int q0, k0, seq_q, seq_k;
  long long pad0;
};
__device__ __forceinline__ Seq varlen_seq(const int* cu_q, const int* cu_k, int b) {
  Seq s;
  s.q0 = __ldg(cu_q + b);
  s.k0 = __ldg(cu_k + b);
  s.seq_q = __ldg(cu_q + b + 1) - s.q0;
  s.seq_k = __ldg(cu_k + b + 1) - s.k0;
  s.pad0 = (long long)(s.q0 & ~3) + (long long)b * (cfg::BLOCK_M + 4);
  return s;
}

// The first query block that key block `n_block` is seen by: causal query i sees keys
// [0, i + diag], so the rows before n0 - diag see none of it. The main kernel visits query
// blocks from here on and the last kernel sums the stored dQ parts of the same ones.
__device__ __forceinline__ int first_query_block(int n_block, int diag) {
  if constexpr (!cfg::CAUSAL) return 0;
  return max(0, n_block * cfg::BLOCK_N - diag) / cfg::BLOCK_M;
}

// This block's query heads (blockIdx.y = kv head x GROUP_SPLIT + split): the first, and how
// many (ceil(kv_group / GROUP_SPLIT) a split, the last split's fewer, or none).
__device__ __forceinline__ int first_head(int kv_group) {
  if constexpr (cfg::GROUP_SPLIT == 1) return blockIdx.y * kv_group;
  const int share = (kv_group + cfg::GROUP_SPLIT - 1) / cfg::GROUP_SPLIT;
  return (blockIdx.y / cfg::GROUP_SPLIT) * kv_group + (blockIdx.y % cfg::GROUP_SPLIT) * share;
}
__device__ __forceinline__ int heads_here(int kv_group) {
  if constexpr (cfg::GROUP_SPLIT == 1) return kv_group;
  const int share = (kv_group + cfg::GROUP_SPLIT - 1) / cfg::GROUP_SPLIT;
  return max(0, min(share, kv_group - (int)(blockIdx.y % cfg::GROUP_SPLIT) * share));
}

extern "C" __global__ void __launch_bounds__(cfg::PRE_THREADS)
attn_bwd_pre(const elem_t* __restrict__ O, const elem_t* __restrict__ dO,
             const float* __restrict__ LSE, float* __restrict__ LSE2, float* __restrict__ DELTA,
             float* __restrict__ dQacc, int seq_q, int heads, int seq_q_pad, long long o_sb,
             long long o_sh, long long o_ss, long long do_sb, long long do_sh, long long do_ss/*%
             if VARLEN is defined and VARLEN %*/, const int* __restrict__ cu_seqlens_q,
             const int* __restrict__ cu_seqlens_k, int total_q/*% endif %*/) {
  using namespace cfg;
#ifdef EVO_BWD_MAIN_PDL
  // The main kernel, this one's programmatic dependent, may start once every block of this one
  // has started: it waits for this one's writes itself (griddepcontrol.wait).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int head = blockIdx.y, batch = blockIdx.z;
  const int row = blockIdx.x * PRE_ROWS + threadIdx.x / 8, sub = threadIdx.x % 8;
  // Where this (batch, head)'s rows start: in the log-sum-exp and dQacc, in LSE2 and DELTA;
  // and how many padded rows it has.
  long long q_rows = ((long long)batch * heads + head) * seq_q;
  long long pad_rows = ((long long)batch * heads + head) * seq_q_pad;
  int pad_len = seq_q_pad;
/*% if VARLEN is defined and VARLEN %*/
  {
    const Seq s = varlen_seq(cu_seqlens_q, cu_seqlens_k, batch);
    seq_q = s.seq_q;
    O += s.q0 * o_ss;
    dO += s.q0 * do_ss;
    q_rows = (long long)head * total_q + s.q0;
    pad_rows = (long long)head * seq_q_pad + s.pad0;
    pad_len = (seq_q + BLOCK_M - 1) / BLOCK_M * BLOCK_M;
  }
/*% endif %*/
  const bool real = row < seq_q;
  float acc = 0.f;
  if (real) {
    const elem_t* o = O + batch * o_sb + head * o_sh + row * o_ss;
    const elem_t* g = dO + batch * do_sb + head * do_sh + row * do_ss;
    for (int c = sub; c < HEAD_DIM / 8; c += 8) {
      const uint4 a = *reinterpret_cast<const uint4*>(o + c * 8);
      const uint4 b = *reinterpret_cast<const uint4*>(g + c * 8);
      const u32 av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float a0, a1, b0, b1;
        unpack2<IS_BF16>(av[i], a0, a1);
        unpack2<IS_BF16>(bv[i], b0, b1);
        acc = fmaf(a0, b0, fmaf(a1, b1, acc));
      }
    }
  }
  // The 8 lanes of a row are 8 aligned lanes of one warp; every lane takes part.
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  acc += __shfl_xor_sync(0xffffffffu, acc, 2);
  acc += __shfl_xor_sync(0xffffffffu, acc, 4);
  if (row < pad_len && sub == 0) {
    const float lse = real ? LSE[q_rows + row] : neg_inf();
    // A row that sees no key (or a padding row) gets +inf, so that its P = exp2(s - inf) is 0.
    LSE2[pad_rows + row] = lse == neg_inf() ? __int_as_float(0x7f800000) : lse * LOG2E;
    DELTA[pad_rows + row] = acc;
  }
  if (dQacc != nullptr && real) {
    float* z = dQacc + (q_rows + row) * HEAD_DIM;
    for (int c = sub; c < HEAD_DIM / 8; c += 8) {
      reinterpret_cast<float4*>(z + c * 8)[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      reinterpret_cast<float4*>(z + c * 8)[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}

extern "C" __global__ void __launch_bounds__(cfg::POST_THREADS)
attn_bwd_post(const float* __restrict__ dQacc, const float* __restrict__ dQpart,
              elem_t* __restrict__ dQ, int seq_q, int seq_k, int heads, long long dq_sb,
              long long dq_sh, long long dq_ss, float scale/*% if VARLEN is defined and VARLEN
              %*/, const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
              int total_q/*% endif %*/) {
  using namespace cfg;
  constexpr int CHUNKS = HEAD_DIM / 8;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int c = blockIdx.x * POST_THREADS + threadIdx.x;
  // Where this (batch, head)'s rows start in dQacc and the parts, and a part's size in rows.
  long long q_rows = ((long long)batch * heads + head) * seq_q;
  long long plane_rows = (long long)gridDim.z * heads * seq_q;
/*% if VARLEN is defined and VARLEN %*/
  {
    const Seq s = varlen_seq(cu_seqlens_q, cu_seqlens_k, batch);
    seq_q = s.seq_q;
    seq_k = s.seq_k;
    dQ += s.q0 * dq_ss;
    q_rows = (long long)head * total_q + s.q0;
    plane_rows = (long long)heads * total_q;
  }
/*% endif %*/
  if (c >= seq_q * CHUNKS) return;
  const int row = c / CHUNKS, col = (c % CHUNKS) * 8;
  float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  auto add = [&](const float* src) {
    const float4 lo = reinterpret_cast<const float4*>(src)[0];
    const float4 hi = reinterpret_cast<const float4*>(src)[1];
    x[0] += lo.x, x[1] += lo.y, x[2] += lo.z, x[3] += lo.w;
    x[4] += hi.x, x[5] += hi.y, x[6] += hi.z, x[7] += hi.w;
  };
  const long long at = (q_rows + row) * HEAD_DIM + col;
  if (dQpart == nullptr && DQACC_TRANSPOSED) {
    // Column col + j (j = 0..7) of 16-column group g = col / 16, half h: at (2 j + h) ^
    // (8 ((row >> 2) & 1)) of group g ^ ((row >> 1) & 1).
    const float* slot = dQacc + (q_rows + row) * HEAD_DIM +
                        16 * ((col / 16) ^ ((row >> 1) & 1)) + (col / 8 % 2);
    const int half = 4 * ((row >> 2) & 1);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = slot[2 * (j ^ half)];
  } else if (dQpart == nullptr && DQACC_FRAGMENT) {
    // Columns col + 2 q + {0, 1} (q = 0..3) of 16-column group g = col / 16, half h: slot
    // g ^ (row & 1), values 4 q + 2 h + {0, 1} of it.
    const float* slot = dQacc + (q_rows + row) * HEAD_DIM +
                        16 * ((col / 16) ^ (row & 1)) + (col / 8 % 2) * 2;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 v = *reinterpret_cast<const float2*>(slot + 4 * q);
      x[2 * q] = v.x, x[2 * q + 1] = v.y;
    }
  } else if (dQpart == nullptr) {
    add(dQacc + at);
  } else {
    // The parts of the key blocks that visited this row's query block, in key order.
    const int n_blocks = (seq_k + BLOCK_N - 1) / BLOCK_N, m_block = row / BLOCK_M;
    const long long plane = plane_rows * HEAD_DIM;
    for (int n = 0; n < n_blocks && first_query_block(n, seq_k - seq_q) <= m_block; ++n)
      add(dQpart + n * plane + at);
  }
  uint4 out;
  out.x = pack2<IS_BF16>(x[0] * scale, x[1] * scale);
  out.y = pack2<IS_BF16>(x[2] * scale, x[3] * scale);
  out.z = pack2<IS_BF16>(x[4] * scale, x[5] * scale);
  out.w = pack2<IS_BF16>(x[6] * scale, x[7] * scale);
  *reinterpret_cast<uint4*>(dQ + batch * dq_sb + head * dq_sh + row * dq_ss + col) = out;
}

// A family that deals a group's query heads to several blocks (wgmma_bwd's GROUP_SPLIT) has
// each store its fp32 share of dK (scaled) and dV; this kernel adds a key row's shares in split
// order and stores dK and dV in fp16/bf16. The shares of (batch, kv head, split) start at
// batch * part_sb + kv_head * part_sh + split * part_split floats (ragged: plus the sequence's
// first key row), HEAD_DIM floats a row; one 8-value chunk per thread, as attn_bwd_post.
extern "C" __global__ void __launch_bounds__(cfg::POST_THREADS)
attn_bwd_kv_post(const float* __restrict__ dKpart, const float* __restrict__ dVpart,
                 elem_t* __restrict__ dK, elem_t* __restrict__ dV, int seq_k, int splits,
                 long long part_sb, long long part_sh, long long part_split, long long dk_sb,
                 long long dk_sh, long long dk_ss, long long dv_sb, long long dv_sh,
                 long long dv_ss/*% if VARLEN is defined and VARLEN %*/,
                 const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
                 int total_q/*% endif %*/) {
  using namespace cfg;
  constexpr int CHUNKS = HEAD_DIM / 8;
  const int kv_head = blockIdx.y, batch = blockIdx.z;
  const int c = blockIdx.x * POST_THREADS + threadIdx.x;
  long long first = 0;  // the sequence's first key row (ragged)
/*% if VARLEN is defined and VARLEN %*/
  {
    const Seq s = varlen_seq(cu_seqlens_q, cu_seqlens_k, batch);
    seq_k = s.seq_k;
    first = s.k0;
  }
/*% endif %*/
  if (c >= seq_k * CHUNKS) return;
  const int row = c / CHUNKS, col = (c % CHUNKS) * 8;
  const long long at = batch * part_sb + kv_head * part_sh + (first + row) * HEAD_DIM + col;
  float k[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int s = 0; s < splits; ++s) {
    const float4* pk = reinterpret_cast<const float4*>(dKpart + at + s * part_split);
    const float4* pv = reinterpret_cast<const float4*>(dVpart + at + s * part_split);
    const float4 k0 = pk[0], k1 = pk[1], v0 = pv[0], v1 = pv[1];
    k[0] += k0.x, k[1] += k0.y, k[2] += k0.z, k[3] += k0.w;
    k[4] += k1.x, k[5] += k1.y, k[6] += k1.z, k[7] += k1.w;
    v[0] += v0.x, v[1] += v0.y, v[2] += v0.z, v[3] += v0.w;
    v[4] += v1.x, v[5] += v1.y, v[6] += v1.z, v[7] += v1.w;
  }
  uint4 ko, vo;
  ko.x = pack2<IS_BF16>(k[0], k[1]), ko.y = pack2<IS_BF16>(k[2], k[3]);
  ko.z = pack2<IS_BF16>(k[4], k[5]), ko.w = pack2<IS_BF16>(k[6], k[7]);
  vo.x = pack2<IS_BF16>(v[0], v[1]), vo.y = pack2<IS_BF16>(v[2], v[3]);
  vo.z = pack2<IS_BF16>(v[4], v[5]), vo.w = pack2<IS_BF16>(v[6], v[7]);
  const long long key = first + row;
  *reinterpret_cast<uint4*>(dK + batch * dk_sb + kv_head * dk_sh + key * dk_ss + col) = ko;
  *reinterpret_cast<uint4*>(dV + batch * dv_sb + kv_head * dv_sh + key * dv_ss + col) = vo;
}
