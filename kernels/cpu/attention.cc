// Softmax attention for XLA's CPU backend as XLA FFI custom calls, float32:
//
// * jmegatron_attention_fwd / _bwd: causal self-attention over a whole sequence, optionally
//   within documents (segment ids: Megatron's reset_attention_mask, a block-diagonal causal
//   mask), with attention dropout. The reference is jmegatron.kernels.xla.attention.xla_attention;
//   the dropout mask is the same counter hash as jmegatron.kernels.xla.dropout.hash_bits over the
//   probabilities' shape [b, nkv, group, s, s], so both paths drop exactly the same elements.
// * jmegatron_attention_block_fwd / _bwd: one block of ring attention (a query block against
//   a key/value block, sq != sk allowed), no mask, causal by position ids (an offset
//   block of the load-balanced layout) and/or segment ids; the forward returns the block's
//   log-sum-exp, the backward takes the final one (Transformer Engine's
//   AttnFuncWithCPAndKVP2P). The reference is jmegatron.parallel.context_parallel's
//   attention_block and _block_grads.
//
// The work follows FlashAttention (Dao et al. 2022, "FlashAttention: Fast and
// Memory-Efficient Exact Attention with IO-Awareness", Algorithms 1 and 4): queries in tiles
// of `block` rows, each tile only against the key tiles it can see (a key tile is skipped
// when its position / segment id ranges rule out every pair; one that every pair sees needs
// no element mask), softmax in a [block, visible keys] scratch, and only the log-sum-exp
// saved for the backward, which recomputes the probabilities. The visible key tiles of a
// query tile are packed side by side into the scratch's columns; each contiguous run of them
// is one single-threaded OpenBLAS call with the head strides as leading dimensions (no
// copies). The tasks run on XLA's intra-op thread pool (parallel.h): (batch, head, query
// tile) in the forward, (batch, head) in the backward.
//
// Layouts (row-major): q [b, sq, nq, d], k and v [b, sk, nkv, d], out [b, sq, nq, d];
// the whole-sequence kernel's lse is [b, nq, s], the block kernel's lse and delta
// (= sum(dout * out, -1)) are [b, sq, nq]; positions and segment ids int32 [b, sq] / [b, sk],
// or the int32 [0] placeholder when their attribute (causal, segments) is false; key uint32
// [3] = the hash's two key words (k0, k1) and the global sample number of batch row 0
// (jmegatron.kernels.xla.dropout's sample_offset).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cblas.h"
#include "checks.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kIntMax = jmegatron::kBlasIntMax;  // OpenBLAS's (32-bit) int

#pragma omp declare simd
inline uint32_t Triple32(uint32_t x) {
  // Wellons' triple32, as jmegatron/models/dropout.py
  x ^= x >> 17;
  x *= 0xED5AD4BBu;
  x ^= x >> 11;
  x *= 0xAC4C1B51u;
  x ^= x >> 15;
  x *= 0x31848BABu;
  x ^= x >> 14;
  return x;
}

// exp(x) for x <= 0 to about 2 ulp, branch-free so loops over it vectorise (Cody-Waite
// reduction, degree-6 polynomial, rounding by the 1.5 * 2^23 trick); 0 below -87 (where
// float32's exp is subnormal: XLA's flushes to 0 as well).
#pragma omp declare simd
inline float ExpNeg(float x_in) {
  const float x = x_in < -87.0f ? -87.0f : x_in;
  const float shifter = 12582912.0f;  // 1.5 * 2^23
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = __builtin_bit_cast(uint32_t, p) + (static_cast<uint32_t>(static_cast<int32_t>(n)) << 23);
  return x_in < -87.0f ? 0.0f : __builtin_bit_cast(float, bits);
}

// ---------------------------------------------------------------------------------------
// Operand checks: a wrong buffer (input or result) is an InvalidArgument error naming it,
// never a crash (checks.h).

using jmegatron::BlasInts;
using jmegatron::Expect;
using jmegatron::Mismatch;

// Position or segment ids: int32 [b, n] when `on`, else the int32 [0] placeholder.
ffi::Error ExpectIds(const char* op, const char* name, const ffi::AnyBuffer& buf, bool on, int64_t b, int64_t n) {
  if (on) return Expect(op, name, buf, ffi::DataType::S32, {b, n});
  if (buf.element_type() == ffi::DataType::S32 && buf.element_count() == 0) return ffi::Error::Success();
  return Mismatch(op, name, "the empty int32[0] placeholder (its attribute is false)", buf);
}

struct Dims {
  int64_t b, sq, sk, nq, nkv, d, group;
};

// q [b, sq, nq, d], k and v [b, sk, nkv, d], float32, nq a multiple of nkv; every size a
// BLAS call sees fits OpenBLAS's int.
ffi::Error CheckQKV(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                    Dims* out) {
  if (q.element_type() != ffi::DataType::F32 || q.dimensions().size() != 4) {
    return Mismatch(op, "q", "float32[b, sq, nq, d]", q);
  }
  auto qd = q.dimensions();
  Dims sh{qd[0], qd[1], 0, qd[2], 0, qd[3], 0};
  auto kd = k.dimensions();
  if (k.element_type() != ffi::DataType::F32 || kd.size() != 4 || kd[0] != sh.b || kd[3] != sh.d ||
      kd[2] == 0 || sh.nq % kd[2] != 0) {
    return Mismatch(op, "k", "float32[b=" + std::to_string(sh.b) + ", sk, nkv, d=" + std::to_string(sh.d) +
                                 "] with nkv dividing q's " + std::to_string(sh.nq) + " heads",
                    k);
  }
  sh.sk = kd[1];
  sh.nkv = kd[2];
  sh.group = sh.nq / sh.nkv;
  if (auto err = Expect(op, "v", v, ffi::DataType::F32, {sh.b, sh.sk, sh.nkv, sh.d}); err.failure()) return err;
  // Every size and leading dimension a BLAS call sees: sq, sk (a tile has at most that many
  // rows or columns), d, and the row lengths nq x d (q, out, dq) and nkv x d (k, v, dk, dv).
  if (auto err = BlasInts(op, {{"sq", sh.sq}, {"sk", sh.sk}, {"d", sh.d}, {"nq", sh.nq}}); err.failure()) return err;
  if (auto err = BlasInts(op, {{"nq x d (q's row length)", jmegatron::SatMul(sh.nq, sh.d)}}); err.failure()) return err;
  *out = sh;
  return ffi::Error::Success();
}

ffi::Error CheckBlock(const char* op, int64_t block) {
  if (block >= 1 && block <= kIntMax) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": block must be in [1, 2^31), got " + std::to_string(block));
}

// ---------------------------------------------------------------------------------------
// Masks: query i sees key j iff (no positions or q_pos[i] >= k_pos[j]) and (no segments or
// q_seg[i] == k_seg[j]); a null pointer turns its test off.

struct MaskRow {  // one batch row's ids
  const int32_t* q_pos;
  const int32_t* k_pos;
  const int32_t* q_seg;
  const int32_t* k_seg;
};

struct MaskIds {  // the whole batch's: row bi starts at bi * stride (0: shared by all rows)
  const int32_t* q_pos = nullptr;
  const int32_t* k_pos = nullptr;
  const int32_t* q_seg = nullptr;
  const int32_t* k_seg = nullptr;
  int64_t q_pos_stride = 0, k_pos_stride = 0, q_seg_stride = 0, k_seg_stride = 0;
  MaskRow Row(int64_t bi) const {
    return {q_pos ? q_pos + bi * q_pos_stride : nullptr, k_pos ? k_pos + bi * k_pos_stride : nullptr,
            q_seg ? q_seg + bi * q_seg_stride : nullptr, k_seg ? k_seg + bi * k_seg_stride : nullptr};
  }
};

struct IdRange {  // the smallest and largest position and segment id of a tile
  int32_t pos_lo, pos_hi, seg_lo, seg_hi;
};

IdRange RangeOf(const int32_t* pos, const int32_t* seg, int64_t start, int64_t n) {
  IdRange r{std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min(),
            std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
  for (int64_t i = start; i < start + n; ++i) {
    if (pos) r.pos_lo = std::min(r.pos_lo, pos[i]), r.pos_hi = std::max(r.pos_hi, pos[i]);
    if (seg) r.seg_lo = std::min(r.seg_lo, seg[i]), r.seg_hi = std::max(r.seg_hi, seg[i]);
  }
  return r;
}

struct Span {  // keys [key, key + len) stored in scratch columns [col, col + len)
  int64_t key, len, col;
};

// The key tiles a query tile computes with: `runs`, contiguous visible key ranges packed
// into `cols` scratch columns; `masked`, the visible tiles some of whose pairs are masked.
struct Plan {
  std::vector<Span> runs, masked;
  int64_t cols = 0;
};

void PlanKeys(const MaskRow& m, const IdRange& qr, const IdRange* key_tiles, int64_t sk, int64_t tile, Plan* plan) {
  plan->runs.clear();
  plan->masked.clear();
  plan->cols = 0;
  const bool causal = m.q_pos != nullptr, segments = m.q_seg != nullptr;
  for (int64_t t = 0, key = 0; key < sk; ++t, key += tile) {
    const IdRange& kr = key_tiles[t];
    if (causal && kr.pos_lo > qr.pos_hi) continue;                                  // every key is later
    if (segments && (kr.seg_lo > qr.seg_hi || kr.seg_hi < qr.seg_lo)) continue;     // no shared segment
    const int64_t len = std::min(tile, sk - key);
    const bool whole = (!causal || kr.pos_hi <= qr.pos_lo) &&
                       (!segments || (kr.seg_lo == kr.seg_hi && qr.seg_lo == qr.seg_hi && kr.seg_lo == qr.seg_lo));
    if (!whole) plan->masked.push_back({key, len, plan->cols});
    if (!plan->runs.empty() && plan->runs.back().key + plan->runs.back().len == key) {
      plan->runs.back().len += len;
    } else {
      plan->runs.push_back({key, len, plan->cols});
    }
    plan->cols += len;
  }
}

// Row kernels over one query row's packed scores; the loops vectorise (#pragma omp simd,
// -fopenmp-simd: reductions without -ffast-math's other licences).

// Scores of the keys query `qi` does not see <- -inf.
inline void MaskScores(float* __restrict row, const Plan& plan, const MaskRow& m, int64_t qi) {
  for (const Span& t : plan.masked) {
    float* __restrict r = row + t.col;
    if (m.q_pos && m.q_seg) {
      const int32_t qp = m.q_pos[qi], qs = m.q_seg[qi];
      const int32_t* kp = m.k_pos + t.key;
      const int32_t* ks = m.k_seg + t.key;
#pragma omp simd
      for (int64_t j = 0; j < t.len; ++j) r[j] = ((qp >= kp[j]) & (qs == ks[j])) ? r[j] : kNegInf;
    } else if (m.q_pos) {
      const int32_t qp = m.q_pos[qi];
      const int32_t* kp = m.k_pos + t.key;
#pragma omp simd
      for (int64_t j = 0; j < t.len; ++j) r[j] = qp >= kp[j] ? r[j] : kNegInf;
    } else {
      const int32_t qs = m.q_seg[qi];
      const int32_t* ks = m.k_seg + t.key;
#pragma omp simd
      for (int64_t j = 0; j < t.len; ++j) r[j] = qs == ks[j] ? r[j] : kNegInf;
    }
  }
}

struct Dropout {
  float rate;
  uint32_t threshold;
  uint32_t k0, k1, sample_offset;
  float keep_scale;  // float32(1 - rate), from Python; applied as a division, as the XLA path
  bool on() const { return rate > 0.0f; }
  // The mask bit of key (column) j of query row qi of head h is
  //   Triple32(Triple32(lead ^ row) ^ j ^ k1) >= threshold,
  // lead = Triple32((sample_offset + batch) ^ k0) (the global sample number, mod 2^32) and
  // row = h * sq + qi, the row-major index over [nkv, group, sq] (< 2^32: checked), so every
  // (sample, head, row, column) hashes a distinct input (jmegatron.kernels.xla.dropout.hash_bits).
  uint32_t Lead(int64_t batch) const { return Triple32((sample_offset + static_cast<uint32_t>(batch)) ^ k0); }
  // The per-row stage: Triple32(lead ^ row).
  uint32_t Row(uint32_t lead, int64_t row) const { return Triple32(lead ^ static_cast<uint32_t>(row)); }
};

const Dropout kNoDropout{0.0f, 0, 0, 0, 0, 1.0f};

// x[j] <- keep(j) ? p(j) / keep_scale : 0 for the keys of `runs`, p(j) = x[j] * inv or x[j];
// `row_hash` = drop.Row(lead, row) of this query row.
inline void DropRow(float* out, const float* probs, const Plan& plan, const Dropout& drop, uint32_t row_hash) {
  const uint32_t k1 = drop.k1, threshold = drop.threshold;
  const float ks = drop.keep_scale;
  for (const Span& r : plan.runs) {
    const uint32_t base = static_cast<uint32_t>(r.key);  // sk < 2^31: no wrap
    float* o = out + r.col;  // may be probs itself (in place)
    const float* p = probs + r.col;
#pragma omp simd
    for (int64_t j = 0; j < r.len; ++j) {
      const bool keep = Triple32(row_hash ^ (base + static_cast<uint32_t>(j)) ^ k1) >= threshold;
      o[j] = keep ? p[j] / ks : 0.0f;
    }
  }
}

// row <- softmax(row) (masked keys -inf -> 0), then the dropout of the row (`row_hash`); returns the
// log-sum-exp, -inf (and a zero row) when the row sees no key.
inline float SoftmaxRow(float* __restrict row, const Plan& plan, const Dropout& drop, uint32_t row_hash) {
  const int64_t n = plan.cols;
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = row[j] > m ? row[j] : m;
  if (m == kNegInf) {
    std::fill(row, row + n, 0.0f);
    return kNegInf;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = ExpNeg(row[j] - m);
    row[j] = e;
    sum += e;
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) row[j] = row[j] / sum;
  if (drop.on()) DropRow(row, row, plan, drop, row_hash);
  return m + std::log(sum);
}

// Backward, first half: row <- P = exp(row - lse) (0 for masked keys, and the whole row
// when lse = -inf: the query sees no key at all); dropped <- P with dropout.
inline void ProbsRow(float* __restrict row, float* __restrict dropped, const Plan& plan, float lse,
                     const Dropout& drop, uint32_t row_hash) {
  const int64_t n = plan.cols;
  if (lse == kNegInf) {
    std::fill(row, row + n, 0.0f);
    if (drop.on()) std::fill(dropped, dropped + n, 0.0f);
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) row[j] = ExpNeg(row[j] - lse);
  if (drop.on()) DropRow(dropped, row, plan, drop, row_hash);
}

// Backward, second half: row <- dS = P * (dP - D), dP the gradient of the undropped
// probabilities (grad of the dropped ones through the mask).
inline void SoftmaxGradRow(float* __restrict row, const float* __restrict grad, const Plan& plan, float dr,
                           const Dropout& drop, uint32_t row_hash) {
  if (drop.on()) {
    const uint32_t k1 = drop.k1, threshold = drop.threshold;
    const float ks = drop.keep_scale;
    for (const Span& r : plan.runs) {
      const uint32_t base = static_cast<uint32_t>(r.key);
      float* __restrict x = row + r.col;
      const float* __restrict g = grad + r.col;
#pragma omp simd
      for (int64_t j = 0; j < r.len; ++j) {
        const bool keep = Triple32(row_hash ^ (base + static_cast<uint32_t>(j)) ^ k1) >= threshold;
        const float gp = keep ? g[j] / ks : 0.0f;
        x[j] = x[j] * (gp - dr);
      }
    }
  } else {
    const int64_t n = plan.cols;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] = row[j] * (grad[j] - dr);
  }
}

inline float Dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t c = 0; c < d; ++c) acc += a[c] * b[c];
  return acc;
}

// ---------------------------------------------------------------------------------------
// The tiled forward and backward shared by both kernels.

struct Problem {
  Dims dims;
  const float* q;
  const float* k;
  const float* v;
  MaskIds mask;
  float scale;
  Dropout drop;
  int64_t tile;
  // element (batch, head, query) of lse (and the block kernel's delta) is at
  // batch * lse_batch + head * lse_head + query * lse_row
  int64_t lse_batch, lse_head, lse_row;
  // The dropout hash's row word of query qi of head h (Dropout::Row).
  int64_t DropRow(int64_t h, int64_t qi) const { return h * dims.sq + qi; }
};

// [b, ceil(sk / tile)]: the id ranges of every key tile.
std::vector<IdRange> KeyTiles(const Problem& p) {
  const int64_t n = (p.dims.sk + p.tile - 1) / p.tile;
  std::vector<IdRange> out(p.dims.b * n);
  for (int64_t bi = 0; bi < p.dims.b; ++bi) {
    const MaskRow m = p.mask.Row(bi);
    for (int64_t t = 0; t < n; ++t) {
      out[bi * n + t] = RangeOf(m.k_pos, m.k_seg, t * p.tile, std::min(p.tile, p.dims.sk - t * p.tile));
    }
  }
  return out;
}

// What the tasks of Forward or Backward use, allocated before the pool runs them: per worker
// a scratch slice of `slice` floats and a plan whose vectors are reserved for every key tile
// (PlanKeys inside a pool task never allocates), so a failed allocation is an error, not a
// terminate (parallel.h).
struct Workspace {
  int64_t workers = 0, slice = 0;
  std::unique_ptr<float[]> scratch;
  std::vector<Plan> plans;

  float* Scratch(int64_t worker) const { return scratch.get() + worker * slice; }
};

// Fills `ws` for `tasks` pool tasks; `what` names the scratch in the allocation error.
ffi::Error AllocateWorkspace(const char* op, const char* what, ffi::ThreadPool& pool, int64_t tasks, int64_t slice,
                             int64_t k_tiles, Workspace* ws) {
  ws->workers = jmegatron::Workers(pool, tasks);
  ws->slice = slice;
  if (auto err = jmegatron::Allocate(op, what, jmegatron::SatMul(ws->workers, slice), &ws->scratch); err.failure()) {
    return err;
  }
  ws->plans.resize(ws->workers);
  for (Plan& plan : ws->plans) {
    plan.runs.reserve(k_tiles);
    plan.masked.reserve(k_tiles);
  }
  return ffi::Error::Success();
}

// Everything a task needs is allocated here, before the pool runs it (Workspace).
ffi::Error Forward(const char* op, ffi::ThreadPool& pool, const Problem& p, float* out, float* lse) {
  const Dims& sh = p.dims;
  const int64_t d = sh.d, ldq = sh.nq * d, ldk = sh.nkv * d, tile = p.tile;
  const int64_t q_tiles = (sh.sq + tile - 1) / tile, k_tiles = (sh.sk + tile - 1) / tile;
  const std::vector<IdRange> key_tiles = KeyTiles(p);
  const int64_t tasks = sh.b * sh.nq * q_tiles;
  Workspace ws;  // per worker: the [rows, visible keys] scores of a tile
  if (auto err = AllocateWorkspace(op, "the attention scores scratch (workers x block x sk floats)", pool, tasks,
                                   std::min(tile, sh.sq) * sh.sk, k_tiles, &ws);
      err.failure()) {
    return err;
  }
  auto task = [&](int64_t t, int64_t worker) {
    const int64_t qt = t % q_tiles, bi = t / q_tiles / sh.nq, h = t / q_tiles % sh.nq, hk = h / sh.group;
    const int64_t q0 = qt * tile, rows = std::min(tile, sh.sq - q0);
    const MaskRow m = p.mask.Row(bi);
    Plan& plan = ws.plans[worker];
    PlanKeys(m, RangeOf(m.q_pos, m.q_seg, q0, rows), key_tiles.data() + bi * k_tiles, sh.sk, tile, &plan);
    const float* Q = p.q + (bi * sh.sq + q0) * ldq + h * d;
    const float* K = p.k + bi * sh.sk * ldk + hk * d;
    const float* V = p.v + bi * sh.sk * ldk + hk * d;
    float* O = out + (bi * sh.sq + q0) * ldq + h * d;
    float* L = lse + bi * p.lse_batch + h * p.lse_head + q0 * p.lse_row;
    const int64_t cols = plan.cols;
    if (cols == 0) {  // no key of this block is visible to any query of the tile
      for (int64_t r = 0; r < rows; ++r) {
        std::fill(O + r * ldq, O + r * ldq + d, 0.0f);
        L[r * p.lse_row] = kNegInf;
      }
      return;
    }
    float* S = ws.Scratch(worker);  // rows x cols, every element written by the sgemm
    for (const Span& run : plan.runs) {
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, run.len, d, p.scale, Q, ldq,
                        K + run.key * ldk, ldk, 0.0f, S + run.col, cols);
    }
    const uint32_t lead = p.drop.on() ? p.drop.Lead(bi) : 0;
    for (int64_t r = 0; r < rows; ++r) {
      MaskScores(S + r * cols, plan, m, q0 + r);
      const uint32_t row_hash = p.drop.on() ? p.drop.Row(lead, p.DropRow(h, q0 + r)) : 0;
      L[r * p.lse_row] = SoftmaxRow(S + r * cols, plan, p.drop, row_hash);
    }
    float beta = 0.0f;
    for (const Span& run : plan.runs) {
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, run.len, 1.0f, S + run.col, cols,
                        V + run.key * ldk, ldk, beta, O, ldq);
      beta = 1.0f;
    }
  };
  return jmegatron::ParallelFor(op, pool, tasks, task);
}

// Gradients of one problem. D = rowsum(dO * O) comes from `delta` (lse's layout) when given,
// else from `out`.
ffi::Error Backward(const char* op, ffi::ThreadPool& pool, const Problem& p, const float* out, const float* dout,
                    const float* lse, const float* delta, float* dq, float* dk, float* dv) {
  const Dims& sh = p.dims;
  const int64_t d = sh.d, ldq = sh.nq * d, ldk = sh.nkv * d, tile = p.tile;
  const int64_t q_tiles = (sh.sq + tile - 1) / tile, k_tiles = (sh.sk + tile - 1) / tile;
  const std::vector<IdRange> key_tiles = KeyTiles(p);
  // One task per (batch, query head). With grouped-query heads the query heads of a group
  // would add into the same dK and dV rows, so each task accumulates into its own [sk, d]
  // slice of `parts` and a second pass sums each group's slices.
  const bool grouped = sh.group > 1;
  // (each task zeroes its slice: no value-initialising pass over all of them here)
  std::unique_ptr<float[]> parts;
  if (grouped) {
    if (auto err = jmegatron::Allocate(op, "the grouped-query dK/dV partial sums (2 x b x nq x sk x d floats)",
                                       jmegatron::SatMul(2 * sh.b * sh.nq, jmegatron::SatMul(sh.sk, d)), &parts);
        err.failure()) {
      return err;
    }
  }
  float* dk_parts = parts.get();
  float* dv_parts = grouped ? dk_parts + sh.b * sh.nq * sh.sk * d : nullptr;
  const int64_t tasks = sh.b * sh.nq;
  // Per worker: probabilities / dS, dP (each [rows, visible keys]), D [tile], and with
  // dropout the dropped probabilities.
  const int64_t width = std::min(tile, sh.sq) * sh.sk;
  Workspace ws;
  if (auto err = AllocateWorkspace(op, "the attention backward scratch (workers x 3 x block x sk floats)", pool,
                                   tasks, (p.drop.on() ? 3 : 2) * width + tile, k_tiles, &ws);
      err.failure()) {
    return err;
  }
  auto task = [&](int64_t t, int64_t worker) {
    const int64_t bi = t / sh.nq, h = t % sh.nq, hk = h / sh.group;
    const float* K = p.k + bi * sh.sk * ldk + hk * d;
    const float* V = p.v + bi * sh.sk * ldk + hk * d;
    const int64_t ldacc = grouped ? d : ldk;
    float* dK = grouped ? dk_parts + t * sh.sk * d : dk + bi * sh.sk * ldk + hk * d;
    float* dV = grouped ? dv_parts + t * sh.sk * d : dv + bi * sh.sk * ldk + hk * d;
    for (int64_t i = 0; i < sh.sk; ++i) {
      std::fill(dK + i * ldacc, dK + i * ldacc + d, 0.0f);
      std::fill(dV + i * ldacc, dV + i * ldacc + d, 0.0f);
    }
    const MaskRow m = p.mask.Row(bi);
    const uint32_t lead = p.drop.on() ? p.drop.Lead(bi) : 0;
    float* const work = ws.Scratch(worker);
    Plan& plan = ws.plans[worker];
    for (int64_t qt = 0; qt < q_tiles; ++qt) {
      const int64_t q0 = qt * tile, rows = std::min(tile, sh.sq - q0);
      PlanKeys(m, RangeOf(m.q_pos, m.q_seg, q0, rows), key_tiles.data() + bi * k_tiles, sh.sk, tile, &plan);
      const int64_t cols = plan.cols;
      const int64_t row0 = (bi * sh.sq + q0) * ldq + h * d;
      const float* Q = p.q + row0;
      const float* dO = dout + row0;
      float* dQ = dq + row0;
      if (cols == 0) {
        for (int64_t r = 0; r < rows; ++r) std::fill(dQ + r * ldq, dQ + r * ldq + d, 0.0f);
        continue;
      }
      float* P = work;                              // probabilities, then dS
      float* dP = P + rows * cols;                  // gradient of the (dropped) probabilities
      float* D = dP + rows * cols;                  // rowsum(dO * O)
      float* Pd = p.drop.on() ? D + tile : nullptr;  // dropped probabilities
      const float* L = lse + bi * p.lse_batch + h * p.lse_head + q0 * p.lse_row;
      for (const Span& run : plan.runs) {
        scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, run.len, d, p.scale, Q, ldq,
                          K + run.key * ldk, ldk, 0.0f, P + run.col, cols);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t qi = q0 + r;
        MaskScores(P + r * cols, plan, m, qi);
        ProbsRow(P + r * cols, Pd ? Pd + r * cols : nullptr, plan, L[r * p.lse_row], p.drop,
                 p.drop.on() ? p.drop.Row(lead, p.DropRow(h, qi)) : 0);
        D[r] = delta ? delta[bi * p.lse_batch + h * p.lse_head + qi * p.lse_row]
                     : Dot(out + row0 + r * ldq, dO + r * ldq, d);
      }
      const float* probs = Pd ? Pd : P;
      for (const Span& run : plan.runs) {
        // dV[run] += Pd[:, run]^T dO_tile;  dP[:, run] = dO_tile V[run]^T
        scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, run.len, d, rows, 1.0f, probs + run.col, cols,
                          dO, ldq, 1.0f, dV + run.key * ldacc, ldacc);
        scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, run.len, d, 1.0f, dO, ldq,
                          V + run.key * ldk, ldk, 0.0f, dP + run.col, cols);
      }
      for (int64_t r = 0; r < rows; ++r) {
        SoftmaxGradRow(P + r * cols, dP + r * cols, plan, D[r], p.drop,
                       p.drop.on() ? p.drop.Row(lead, p.DropRow(h, q0 + r)) : 0);
      }
      float beta = 0.0f;
      for (const Span& run : plan.runs) {
        // dQ_tile = scale sum_runs dS[:, run] K[run];  dK[run] += scale dS[:, run]^T Q_tile
        scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, run.len, p.scale, P + run.col, cols,
                          K + run.key * ldk, ldk, beta, dQ, ldq);
        scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, run.len, d, rows, p.scale, P + run.col, cols, Q,
                          ldq, 1.0f, dK + run.key * ldacc, ldacc);
        beta = 1.0f;
      }
    }
  };
  if (auto err = jmegatron::ParallelFor(op, pool, tasks, task); err.failure()) return err;
  if (grouped) {  // dK, dV of each (batch, kv head) = the sum over its group's slices
    auto reduce = [&](int64_t t) {
      const int64_t bi = t / sh.nkv, hk = t % sh.nkv;
      const int64_t first = bi * sh.nq + hk * sh.group;
      for (int64_t i = 0; i < sh.sk; ++i) {
        float* dk_row = dk + (bi * sh.sk + i) * ldk + hk * d;
        float* dv_row = dv + (bi * sh.sk + i) * ldk + hk * d;
        std::fill(dk_row, dk_row + d, 0.0f);
        std::fill(dv_row, dv_row + d, 0.0f);
        for (int64_t g = 0; g < sh.group; ++g) {
          const float* pk_row = dk_parts + ((first + g) * sh.sk + i) * d;
          const float* pv_row = dv_parts + ((first + g) * sh.sk + i) * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) {
            dk_row[c] += pk_row[c];
            dv_row[c] += pv_row[c];
          }
        }
      }
    };
    return jmegatron::ParallelFor(op, pool, sh.b * sh.nkv, reduce);
  }
  return ffi::Error::Success();
}

// Forward after checking its results, float32: out [b, sq, nq, d] and lse `lse_dims`.
ffi::Error CheckedForward(const char* op, ffi::ThreadPool& pool, const Problem& p, const ffi::AnyBuffer& out,
                          const ffi::AnyBuffer& lse, std::vector<int64_t> lse_dims) {
  const Dims& sh = p.dims;
  if (auto err = jmegatron::ExpectAll(op, ffi::DataType::F32,
                                      {{"out", &out, {sh.b, sh.sq, sh.nq, sh.d}}, {"lse", &lse, std::move(lse_dims)}});
      err.failure()) {
    return err;
  }
  return Forward(op, pool, p, out.typed_data<float>(), lse.typed_data<float>());
}

// Backward after checking its buffers, float32: out (when given; else delta is) and dout
// [b, sq, nq, d], lse and delta `lse_dims`, dq like q, dk and dv like k.
ffi::Error CheckedBackward(const char* op, ffi::ThreadPool& pool, const Problem& p, const ffi::AnyBuffer* out,
                           const ffi::AnyBuffer& dout, const ffi::AnyBuffer& lse, const ffi::AnyBuffer* delta,
                           const std::vector<int64_t>& lse_dims, const ffi::AnyBuffer& dq, const ffi::AnyBuffer& dk,
                           const ffi::AnyBuffer& dv) {
  const Dims& sh = p.dims;
  const std::vector<int64_t> q_shape{sh.b, sh.sq, sh.nq, sh.d}, k_shape{sh.b, sh.sk, sh.nkv, sh.d};
  std::vector<jmegatron::Want> wants;
  if (out != nullptr) wants.push_back({"out", out, q_shape});
  wants.push_back({"dout", &dout, q_shape});
  wants.push_back({"lse", &lse, lse_dims});
  if (delta != nullptr) wants.push_back({"delta", delta, lse_dims});
  wants.insert(wants.end(), {{"dq", &dq, q_shape}, {"dk", &dk, k_shape}, {"dv", &dv, k_shape}});
  if (auto err = jmegatron::ExpectAll(op, ffi::DataType::F32, wants); err.failure()) return err;
  return Backward(op, pool, p, out ? out->typed_data<float>() : nullptr, dout.typed_data<float>(),
                  lse.typed_data<float>(), delta ? delta->typed_data<float>() : nullptr, dq.typed_data<float>(),
                  dk.typed_data<float>(), dv.typed_data<float>());
}

// ---------------------------------------------------------------------------------------
// jmegatron_attention_fwd / _bwd: causal (and optionally same-document) self-attention.

constexpr char kFwd[] = "jmegatron_attention_fwd";
constexpr char kBwd[] = "jmegatron_attention_bwd";

// Checks the whole-sequence kernel's q, k, v, segment ids and dropout key; fills `p` (its
// causal mask reads `iota`, the positions 0..s-1 shared by all rows).
ffi::Error SequenceProblem(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                           const ffi::AnyBuffer& v, const ffi::AnyBuffer& segment_ids, const ffi::AnyBuffer& key,
                           bool segments, float scale, float dropout_rate, float keep_scale, int64_t threshold,
                           int64_t block, std::vector<int32_t>* iota, Problem* p) {
  if (auto err = CheckQKV(op, q, k, v, &p->dims); err.failure()) return err;
  const Dims& sh = p->dims;
  if (sh.sk != sh.sq) {
    return Mismatch(op, "k", "float32[b, s=" + std::to_string(sh.sq) + ", nkv, d] (q's sequence length)", k);
  }
  if (auto err = ExpectIds(op, "segment_ids", segment_ids, segments, sh.b, sh.sq); err.failure()) return err;
  if (auto err = Expect(op, "key", key, ffi::DataType::U32, {3}); err.failure()) return err;
  if (auto err = CheckBlock(op, block); err.failure()) return err;
  if (!(dropout_rate >= 0.0f && dropout_rate < 1.0f) || threshold < 0 || threshold > 0xFFFFFFFFll ||
      !(keep_scale > 0.0f)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": dropout attributes out of range (dropout_rate " +
                                       std::to_string(dropout_rate) + " must be in [0, 1), threshold " +
                                       std::to_string(threshold) + " in [0, 2^32), keep_scale " +
                                       std::to_string(keep_scale) + " > 0)");
  }
  // The dropout hash's row word h * s + i must not wrap (Dropout::Row): nq x s <= 2^32.
  if (dropout_rate > 0.0f && jmegatron::SatMul(sh.nq, sh.sq) > (int64_t{1} << 32)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": attention dropout needs heads x sequence <= 2^32 (the "
                                       "hash's row word), got nq = " + std::to_string(sh.nq) + " x s = " +
                                       std::to_string(sh.sq) + "; use fewer heads per device (tensor "
                                       "parallelism) or attention_dropout = 0");
  }
  iota->resize(sh.sq);
  for (int64_t i = 0; i < sh.sq; ++i) (*iota)[i] = static_cast<int32_t>(i);
  p->q = q.typed_data<float>();
  p->k = k.typed_data<float>();
  p->v = v.typed_data<float>();
  p->mask.q_pos = p->mask.k_pos = iota->data();
  if (segments) {
    p->mask.q_seg = p->mask.k_seg = segment_ids.typed_data<int32_t>();
    p->mask.q_seg_stride = p->mask.k_seg_stride = sh.sq;
  }
  const uint32_t* kw = key.typed_data<uint32_t>();
  p->scale = scale;
  p->drop = Dropout{dropout_rate, static_cast<uint32_t>(threshold), kw[0], kw[1], kw[2], keep_scale};
  p->tile = block;
  p->lse_batch = sh.nq * sh.sq;  // lse [b, nq, s]
  p->lse_head = sh.sq;
  p->lse_row = 1;
  return ffi::Error::Success();
}

ffi::Error AttentionFwdBody(ffi::ThreadPool& pool, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                            const ffi::AnyBuffer& v, const ffi::AnyBuffer& segment_ids, const ffi::AnyBuffer& key,
                            ffi::Result<ffi::AnyBuffer>& out, ffi::Result<ffi::AnyBuffer>& lse, float scale,
                            float dropout_rate, float keep_scale, int64_t threshold, int64_t block, bool segments) {
  Problem p;
  std::vector<int32_t> iota;
  if (auto err = SequenceProblem(kFwd, q, k, v, segment_ids, key, segments, scale, dropout_rate, keep_scale,
                                 threshold, block, &iota, &p);
      err.failure()) {
    return err;
  }
  return CheckedForward(kFwd, pool, p, *out, *lse, {p.dims.b, p.dims.nq, p.dims.sq});
}

ffi::Error AttentionBwdBody(ffi::ThreadPool& pool, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                            const ffi::AnyBuffer& v, const ffi::AnyBuffer& out, const ffi::AnyBuffer& dout,
                            const ffi::AnyBuffer& lse, const ffi::AnyBuffer& segment_ids, const ffi::AnyBuffer& key,
                            ffi::Result<ffi::AnyBuffer>& dq, ffi::Result<ffi::AnyBuffer>& dk,
                            ffi::Result<ffi::AnyBuffer>& dv, float scale, float dropout_rate, float keep_scale,
                            int64_t threshold, int64_t block, bool segments) {
  Problem p;
  std::vector<int32_t> iota;
  if (auto err = SequenceProblem(kBwd, q, k, v, segment_ids, key, segments, scale, dropout_rate, keep_scale,
                                 threshold, block, &iota, &p);
      err.failure()) {
    return err;
  }
  return CheckedBackward(kBwd, pool, p, &out, dout, lse, nullptr, {p.dims.b, p.dims.nq, p.dims.sq}, *dq, *dk, *dv);
}

// ---------------------------------------------------------------------------------------
// jmegatron_attention_block_fwd / _bwd: one ring-attention block.

constexpr char kBlockFwd[] = "jmegatron_attention_block_fwd";
constexpr char kBlockBwd[] = "jmegatron_attention_block_bwd";

ffi::Error BlockProblem(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::AnyBuffer& q_positions, const ffi::AnyBuffer& k_positions,
                        const ffi::AnyBuffer& q_segments, const ffi::AnyBuffer& k_segments, bool causal,
                        bool segments, float scale, int64_t block, Problem* p) {
  if (auto err = CheckQKV(op, q, k, v, &p->dims); err.failure()) return err;
  const Dims& sh = p->dims;
  const std::pair<const char*, const ffi::AnyBuffer*> q_ids[] = {{"q_positions", &q_positions},
                                                                  {"q_segments", &q_segments}};
  const std::pair<const char*, const ffi::AnyBuffer*> k_ids[] = {{"k_positions", &k_positions},
                                                                  {"k_segments", &k_segments}};
  for (int i = 0; i < 2; ++i) {
    const bool on = i == 0 ? causal : segments;
    if (auto err = ExpectIds(op, q_ids[i].first, *q_ids[i].second, on, sh.b, sh.sq); err.failure()) return err;
    if (auto err = ExpectIds(op, k_ids[i].first, *k_ids[i].second, on, sh.b, sh.sk); err.failure()) return err;
  }
  if (auto err = CheckBlock(op, block); err.failure()) return err;
  p->q = q.typed_data<float>();
  p->k = k.typed_data<float>();
  p->v = v.typed_data<float>();
  if (causal) {
    p->mask.q_pos = q_positions.typed_data<int32_t>();
    p->mask.k_pos = k_positions.typed_data<int32_t>();
    p->mask.q_pos_stride = sh.sq;
    p->mask.k_pos_stride = sh.sk;
  }
  if (segments) {
    p->mask.q_seg = q_segments.typed_data<int32_t>();
    p->mask.k_seg = k_segments.typed_data<int32_t>();
    p->mask.q_seg_stride = sh.sq;
    p->mask.k_seg_stride = sh.sk;
  }
  p->scale = scale;
  p->drop = kNoDropout;
  p->tile = block;
  p->lse_batch = sh.sq * sh.nq;  // lse and delta [b, sq, nq]
  p->lse_head = 1;
  p->lse_row = sh.nq;
  return ffi::Error::Success();
}

ffi::Error BlockFwdBody(ffi::ThreadPool& pool, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                        const ffi::AnyBuffer& v, const ffi::AnyBuffer& q_positions, const ffi::AnyBuffer& k_positions,
                        const ffi::AnyBuffer& q_segments, const ffi::AnyBuffer& k_segments,
                        ffi::Result<ffi::AnyBuffer>& out, ffi::Result<ffi::AnyBuffer>& lse, float scale, bool causal,
                        bool segments, int64_t block) {
  Problem p;
  if (auto err = BlockProblem(kBlockFwd, q, k, v, q_positions, k_positions, q_segments, k_segments, causal,
                              segments, scale, block, &p);
      err.failure()) {
    return err;
  }
  return CheckedForward(kBlockFwd, pool, p, *out, *lse, {p.dims.b, p.dims.sq, p.dims.nq});
}

ffi::Error BlockBwdBody(ffi::ThreadPool& pool, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                        const ffi::AnyBuffer& v, const ffi::AnyBuffer& dout, const ffi::AnyBuffer& lse,
                        const ffi::AnyBuffer& delta, const ffi::AnyBuffer& q_positions,
                        const ffi::AnyBuffer& k_positions, const ffi::AnyBuffer& q_segments,
                        const ffi::AnyBuffer& k_segments, ffi::Result<ffi::AnyBuffer>& dq,
                        ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv, float scale, bool causal,
                        bool segments, int64_t block) {
  Problem p;
  if (auto err = BlockProblem(kBlockBwd, q, k, v, q_positions, k_positions, q_segments, k_segments, causal,
                              segments, scale, block, &p);
      err.failure()) {
    return err;
  }
  return CheckedBackward(kBlockBwd, pool, p, nullptr, dout, lse, &delta, {p.dims.b, p.dims.sq, p.dims.nq}, *dq, *dk,
                         *dv);
}

// The handlers' attributes, as jmegatron.kernels.cpu.ops passes them: types and names.
using SequenceAttrs = std::tuple<float, float, float, int64_t, int64_t, bool>;
constexpr const char* kSequenceAttrs[] = {"scale", "dropout_rate", "keep_scale", "threshold", "block", "segments"};
using BlockAttrs = std::tuple<float, bool, bool, int64_t>;
constexpr const char* kBlockAttrs[] = {"scale", "causal", "segments", "block"};

}  // namespace

// The handlers run their bodies under jmegatron::Guarded (no exception leaves them).
// q, k, v, segment_ids, key -> out, lse
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronAttentionFwd, jmegatron::GuardedHandler(kFwd, AttentionFwdBody),
                              (jmegatron::AttrBinding<5, 2, SequenceAttrs>(kSequenceAttrs)));

// q, k, v, out, dout, lse, segment_ids, key -> dq, dk, dv
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronAttentionBwd, jmegatron::GuardedHandler(kBwd, AttentionBwdBody),
                              (jmegatron::AttrBinding<8, 3, SequenceAttrs>(kSequenceAttrs)));

// q, k, v, q_positions, k_positions, q_segments, k_segments -> out, lse
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronAttentionBlockFwd, jmegatron::GuardedHandler(kBlockFwd, BlockFwdBody),
                              (jmegatron::AttrBinding<7, 2, BlockAttrs>(kBlockAttrs)));

// q, k, v, dout, lse, delta, q_positions, k_positions, q_segments, k_segments -> dq, dk, dv
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronAttentionBlockBwd, jmegatron::GuardedHandler(kBlockBwd, BlockBwdBody),
                              (jmegatron::AttrBinding<10, 3, BlockAttrs>(kBlockAttrs)));
