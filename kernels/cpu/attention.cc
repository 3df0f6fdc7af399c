// Causal softmax attention for XLA's CPU backend as XLA FFI custom calls
// (jmegatron_attention_fwd / jmegatron_attention_bwd).
//
// out = dropout(softmax(scale * q k^T, causal)) v per (batch, query head), float32,
// with grouped-query heads (query head h reads key/value head h / group). The
// reference is jmegatron.models.attention.xla_attention; the dropout mask is the same
// counter hash as jmegatron.models.dropout.hash_bits over the probabilities' shape
// [b, nkv, group, s, s], so both paths drop exactly the same elements.
//
// The work follows FlashAttention (Dao et al. 2022, "FlashAttention: Fast and
// Memory-Efficient Exact Attention with IO-Awareness"): queries in blocks of `block`
// rows, each block only against the keys it can see (causal), softmax in registers of
// a [block, keys] scratch, and only the log-sum-exp saved for the backward, which
// recomputes the probabilities. The matmuls are single-threaded OpenBLAS calls with
// the head strides as leading dimensions (no copies); the (batch, head) tasks run on
// XLA's intra-op thread pool (parallel.h).
//
// Layouts (row-major): q [b, s, nq, d], k and v [b, s, nkv, d], out [b, s, nq, d],
// lse [b, nq, s]; key uint32 [3] = the hash's two key words (k0, k1) and the global
// sample number of batch row 0 (jmegatron.models.dropout's sample_offset).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cblas.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

struct Shape {
  int64_t b, s, nq, nkv, d, group;
};

ffi::Error CheckShapes(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k,
                       const ffi::Buffer<ffi::F32>& v, Shape* out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument("jmegatron_attention: q, k, v must be [b, s, heads, d]");
  }
  Shape sh{qd[0], qd[1], qd[2], kd[2], qd[3], 0};
  if (kd[0] != sh.b || kd[1] != sh.s || kd[3] != sh.d || vd[0] != sh.b || vd[1] != sh.s ||
      vd[2] != sh.nkv || vd[3] != sh.d || sh.nkv == 0 || sh.nq % sh.nkv != 0) {
    return ffi::Error::InvalidArgument("jmegatron_attention: k/v shapes do not match q");
  }
  sh.group = sh.nq / sh.nkv;
  *out = sh;
  return ffi::Error::Success();
}

struct Dropout {
  float rate;
  uint32_t threshold;
  uint32_t k0, k1, sample_offset;
  float keep_scale;  // float32(1 - rate), from Python; applied as a division, as the XLA path
  bool on() const { return rate > 0.0f; }
  // The mask bit of element j of a row is Triple32(lead ^ (rest + j) ^ k1) >= threshold,
  // lead = Triple32((sample_offset + batch) ^ k0) (the global sample number, mod 2^32) and
  // rest = (h * s + qi) * s mod 2^32, the row-major index over [nkv, group, s, s]
  // (jmegatron.models.dropout.hash_bits).
  uint32_t Lead(int64_t batch) const { return Triple32((sample_offset + static_cast<uint32_t>(batch)) ^ k0); }
};

// Row kernels over the n <= cols visible keys of one query row; the loops vectorise
// (#pragma omp simd, -fopenmp-simd: reductions without -ffast-math's other licences).

// row[0:n) <- softmax(row[0:n)) with the dropout of row `rest`, row[n:cols) <- 0; returns
// the log-sum-exp.
inline float SoftmaxDropoutRow(float* __restrict row, int64_t n, int64_t cols, const Dropout& drop,
                               uint32_t lead, uint32_t rest) {
  float m = row[0];
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = row[j] > m ? row[j] : m;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = ExpNeg(row[j] - m);
    row[j] = e;
    sum += e;
  }
  if (drop.on()) {
    const uint32_t k1 = drop.k1, threshold = drop.threshold;
    const float ks = drop.keep_scale;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const float p = row[j] / sum;
      const bool keep = Triple32(lead ^ (rest + static_cast<uint32_t>(j)) ^ k1) >= threshold;
      row[j] = keep ? p / ks : 0.0f;
    }
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] = row[j] / sum;
  }
  for (int64_t j = n; j < cols; ++j) row[j] = 0.0f;
  return m + std::log(sum);
}

// Backward, first half: row <- P = exp(row - lse) (0 past n); dropped <- P with dropout.
inline void ProbsRow(float* __restrict row, float* __restrict dropped, int64_t n, int64_t cols, float lse,
                     const Dropout& drop, uint32_t lead, uint32_t rest) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) row[j] = ExpNeg(row[j] - lse);
  for (int64_t j = n; j < cols; ++j) row[j] = 0.0f;
  if (!drop.on()) return;
  const uint32_t k1 = drop.k1, threshold = drop.threshold;
  const float ks = drop.keep_scale;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const bool keep = Triple32(lead ^ (rest + static_cast<uint32_t>(j)) ^ k1) >= threshold;
    dropped[j] = keep ? row[j] / ks : 0.0f;
  }
  for (int64_t j = n; j < cols; ++j) dropped[j] = 0.0f;
}

// Backward, second half: row <- dS = P * (dP - D), dP the gradient of the undropped
// probabilities (grad of the dropped ones through the mask).
inline void SoftmaxGradRow(float* __restrict row, const float* __restrict grad, int64_t n, float dr,
                           const Dropout& drop, uint32_t lead, uint32_t rest) {
  if (drop.on()) {
    const uint32_t k1 = drop.k1, threshold = drop.threshold;
    const float ks = drop.keep_scale;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const bool keep = Triple32(lead ^ (rest + static_cast<uint32_t>(j)) ^ k1) >= threshold;
      const float gp = keep ? grad[j] / ks : 0.0f;
      row[j] = row[j] * (gp - dr);
    }
  } else {
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

ffi::Error AttentionFwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::U32> key,
                        ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                        float scale, float dropout_rate, float keep_scale, int64_t threshold, int64_t block) {
  Shape sh;
  if (auto err = CheckShapes(q, k, v, &sh); err.failure()) return err;
  if (key.element_count() != 3) {
    return ffi::Error::InvalidArgument("jmegatron_attention: key must be uint32[3] (k0, k1, sample_offset)");
  }
  const uint32_t* kw = key.typed_data();
  const Dropout drop{dropout_rate, static_cast<uint32_t>(threshold), kw[0], kw[1], kw[2], keep_scale};
  const float* pq = q.typed_data();
  const float* pk = k.typed_data();
  const float* pv = v.typed_data();
  float* po = out->typed_data();
  float* pl = lse->typed_data();
  const int64_t s = sh.s, d = sh.d, ldq = sh.nq * d, ldk = sh.nkv * d;
  const int64_t bq = std::max<int64_t>(1, std::min(block, s));

  auto task = [&](int64_t t) {
    const int64_t bi = t / sh.nq, h = t % sh.nq, hk = h / sh.group;
    const float* Q = pq + bi * s * ldq + h * d;
    const float* K = pk + bi * s * ldk + hk * d;
    const float* V = pv + bi * s * ldk + hk * d;
    float* O = po + bi * s * ldq + h * d;
    float* L = pl + (bi * sh.nq + h) * s;
    const uint32_t lead = drop.Lead(bi);
    std::vector<float> scratch(bq * s);
    float* S = scratch.data();
    for (int64_t q0 = 0; q0 < s; q0 += bq) {
      const int64_t rows = std::min(bq, s - q0), cols = q0 + rows;
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, d, scale, Q + q0 * ldq, ldq, K,
                        ldk, 0.0f, S, cols);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t qi = q0 + r;
        L[qi] = SoftmaxDropoutRow(S + r * cols, qi + 1, cols, drop, lead, static_cast<uint32_t>((h * s + qi) * s));
      }
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, cols, 1.0f, S, cols, V, ldk, 0.0f,
                        O + q0 * ldq, ldq);
    }
  };
  jmegatron::ParallelFor(pool, sh.b * sh.nq, task);
  return ffi::Error::Success();
}

ffi::Error AttentionBwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> dout,
                        ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::U32> key,
                        ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                        ffi::ResultBuffer<ffi::F32> dv, float scale, float dropout_rate, float keep_scale,
                        int64_t threshold, int64_t block) {
  Shape sh;
  if (auto err = CheckShapes(q, k, v, &sh); err.failure()) return err;
  if (key.element_count() != 3) {
    return ffi::Error::InvalidArgument("jmegatron_attention: key must be uint32[3] (k0, k1, sample_offset)");
  }
  const uint32_t* kw = key.typed_data();
  const Dropout drop{dropout_rate, static_cast<uint32_t>(threshold), kw[0], kw[1], kw[2], keep_scale};
  const float* pq = q.typed_data();
  const float* pk = k.typed_data();
  const float* pv = v.typed_data();
  const float* po = out.typed_data();
  const float* pdo = dout.typed_data();
  const float* pl = lse.typed_data();
  float* pdq = dq->typed_data();
  float* pdk = dk->typed_data();
  float* pdv = dv->typed_data();
  const int64_t s = sh.s, d = sh.d, ldq = sh.nq * d, ldk = sh.nkv * d;
  const int64_t bq = std::max<int64_t>(1, std::min(block, s));

  // One task per (batch, query head), as the forward. With grouped-query heads the query
  // heads of a group would add into the same dK and dV rows, so each task accumulates into
  // its own [s, d] slice of `parts` and a second pass sums each group's slices.
  const bool grouped = sh.group > 1;
  std::vector<float> parts(grouped ? 2 * sh.b * sh.nq * s * d : 0);
  float* dk_parts = parts.data();
  float* dv_parts = grouped ? dk_parts + sh.b * sh.nq * s * d : nullptr;
  auto task = [&](int64_t t) {
    const int64_t bi = t / sh.nq, h = t % sh.nq, hk = h / sh.group;
    const float* K = pk + bi * s * ldk + hk * d;
    const float* V = pv + bi * s * ldk + hk * d;
    const int64_t ldacc = grouped ? d : ldk;
    float* dK = grouped ? dk_parts + t * s * d : pdk + bi * s * ldk + hk * d;
    float* dV = grouped ? dv_parts + t * s * d : pdv + bi * s * ldk + hk * d;
    for (int64_t i = 0; i < s; ++i) {
      std::fill(dK + i * ldacc, dK + i * ldacc + d, 0.0f);
      std::fill(dV + i * ldacc, dV + i * ldacc + d, 0.0f);
    }
    const uint32_t lead = drop.Lead(bi);
    std::vector<float> scratch(3 * bq * s + bq);
    float* P = scratch.data();          // probabilities, then dS
    float* Pd = P + bq * s;             // dropped probabilities
    float* dP = Pd + bq * s;            // gradient of the dropped probabilities
    float* D = dP + bq * s;             // rowsum(dO * O)
    {
      const float* Q = pq + bi * s * ldq + h * d;
      const float* O = po + bi * s * ldq + h * d;
      const float* dO = pdo + bi * s * ldq + h * d;
      float* dQ = pdq + bi * s * ldq + h * d;
      const float* L = pl + (bi * sh.nq + h) * s;
      for (int64_t q0 = 0; q0 < s; q0 += bq) {
        const int64_t rows = std::min(bq, s - q0), cols = q0 + rows;
        scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, d, scale, Q + q0 * ldq, ldq, K,
                          ldk, 0.0f, P, cols);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t qi = q0 + r;
          ProbsRow(P + r * cols, Pd + r * cols, qi + 1, cols, L[qi], drop, lead,
                   static_cast<uint32_t>((h * s + qi) * s));
          D[r] = Dot(O + qi * ldq, dO + qi * ldq, d);
        }
        const float* probs = drop.on() ? Pd : P;
        // dV[:cols] += Pd^T dO_blk
        scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, d, rows, 1.0f, probs, cols,
                          dO + q0 * ldq, ldq, 1.0f, dV, ldacc);
        // dPd = dO_blk V[:cols]^T
        scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, d, 1.0f, dO + q0 * ldq, ldq, V,
                          ldk, 0.0f, dP, cols);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t qi = q0 + r;
          SoftmaxGradRow(P + r * cols, dP + r * cols, qi + 1, D[r], drop, lead,
                         static_cast<uint32_t>((h * s + qi) * s));
        }
        // dQ_blk = scale dS K[:cols];  dK[:cols] += scale dS^T Q_blk
        scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, cols, scale, P, cols, K, ldk, 0.0f,
                          dQ + q0 * ldq, ldq);
        scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, d, rows, scale, P, cols, Q + q0 * ldq,
                          ldq, 1.0f, dK, ldacc);
      }
    }
  };
  jmegatron::ParallelFor(pool, sh.b * sh.nq, task);
  if (grouped) {  // dK, dV of each (batch, kv head) = the sum over its group's slices
    auto reduce = [&](int64_t t) {
      const int64_t bi = t / sh.nkv, hk = t % sh.nkv;
      const int64_t first = bi * sh.nq + hk * sh.group;
      for (int64_t i = 0; i < s; ++i) {
        float* dk_row = pdk + (bi * s + i) * ldk + hk * d;
        float* dv_row = pdv + (bi * s + i) * ldk + hk * d;
        std::fill(dk_row, dk_row + d, 0.0f);
        std::fill(dv_row, dv_row + d, 0.0f);
        for (int64_t g = 0; g < sh.group; ++g) {
          const float* pk_row = dk_parts + ((first + g) * s + i) * d;
          const float* pv_row = dv_parts + ((first + g) * s + i) * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) {
            dk_row[c] += pk_row[c];
            dv_row[c] += pv_row[c];
          }
        }
      }
    };
    jmegatron::ParallelFor(pool, sh.b * sh.nkv, reduce);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronAttentionFwd, AttentionFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::U32>>()  // key
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<float>("scale")
                                  .Attr<float>("dropout_rate")
                                  .Attr<float>("keep_scale")
                                  .Attr<int64_t>("threshold")
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronAttentionBwd, AttentionBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // out
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dout
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::U32>>()  // key
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dv
                                  .Attr<float>("scale")
                                  .Attr<float>("dropout_rate")
                                  .Attr<float>("keep_scale")
                                  .Attr<int64_t>("threshold")
                                  .Attr<int64_t>("block"));
