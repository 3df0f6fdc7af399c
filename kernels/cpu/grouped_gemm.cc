// Grouped float32 GEMM for XLA's CPU backend as XLA FFI custom calls: the routed experts of
// an MoE layer (the role of Megatron-Core's GroupedMLP / grouped_gemm), where the rows of
// A are sorted by group (expert) and group e has sizes[e] consecutive rows.
//
// jmegatron_grouped_sgemm:        C[N, P] rows of group e = A[rows of e, K] @ op(B[e]),
//                                 B [E, K, P] (trans_b: [E, P, K]); rows past sum(sizes): 0.
// jmegatron_grouped_sgemm_wgrad:  C[E, K, P], C[e] = A[rows of e]^T @ G[rows of e],
//                                 A [N, K], G [N, P] (the weight gradient).
//
// jax.lax.ragged_dot (the XLA reference path) computes about every group's product over
// all N rows on XLA:CPU; here each group is one OpenBLAS call on its own rows (panels of
// rows, or of columns for the weight gradient, spread over XLA's intra-op pool).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cblas.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 128;  // rows (or columns) per task

// Prefix sums of the group sizes; an error for negative sizes or more rows than n.
ffi::Error Offsets(ffi::Buffer<ffi::S32> sizes, int64_t n, std::vector<int64_t>* offsets) {
  const int64_t groups = sizes.dimensions()[0];
  const int32_t* s = sizes.typed_data();
  offsets->assign(groups + 1, 0);
  for (int64_t e = 0; e < groups; ++e) {
    if (s[e] < 0) return ffi::Error::InvalidArgument("jmegatron_grouped_sgemm: a group size is negative");
    (*offsets)[e + 1] = (*offsets)[e] + s[e];
  }
  if ((*offsets)[groups] > n) {
    return ffi::Error::InvalidArgument("jmegatron_grouped_sgemm: the group sizes add up to more rows than A has");
  }
  return ffi::Error::Success();
}

ffi::Error GroupedSgemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                        ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> c, bool trans_b) {
  auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  if (ad.size() != 2 || bd.size() != 3 || cd.size() != 2 || sizes.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("jmegatron_grouped_sgemm: A [N, K], B [E, K, P], sizes [E], C [N, P]");
  }
  const int64_t n = ad[0], k = ad[1], groups = bd[0];
  const int64_t kb = trans_b ? bd[2] : bd[1], p = trans_b ? bd[1] : bd[2];
  if (kb != k || sizes.dimensions()[0] != groups || cd[0] != n || cd[1] != p) {
    return ffi::Error::InvalidArgument("jmegatron_grouped_sgemm: shapes do not match");
  }
  std::vector<int64_t> off;
  if (auto err = Offsets(sizes, n, &off); !err.success()) return err;
  const float* pa = a.typed_data();
  const float* pb = b.typed_data();
  float* pc = c->typed_data();
  std::fill(pc + off[groups] * p, pc + n * p, 0.0f);  // rows outside every group
  if (p == 0) return ffi::Error::Success();
  struct Task { int64_t e, lo, hi; };
  std::vector<Task> tasks;
  for (int64_t e = 0; e < groups; ++e)
    for (int64_t lo = off[e]; lo < off[e + 1]; lo += kPanel) tasks.push_back({e, lo, std::min(lo + kPanel, off[e + 1])});
  const int64_t ldb = trans_b ? k : p;
  auto run = [&](int64_t t) {
    const Task& task = tasks[t];
    if (k == 0) {
      std::fill(pc + task.lo * p, pc + task.hi * p, 0.0f);
      return;
    }
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, task.hi - task.lo, p, k,
                      1.0f, pa + task.lo * k, k, pb + task.e * k * p, ldb, 0.0f, pc + task.lo * p, p);
  };
  jmegatron::ParallelFor(pool, static_cast<int64_t>(tasks.size()), run);
  return ffi::Error::Success();
}

ffi::Error GroupedSgemmWgrad(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> g,
                             ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> c) {
  auto ad = a.dimensions(), gd = g.dimensions(), cd = c->dimensions();
  if (ad.size() != 2 || gd.size() != 2 || cd.size() != 3 || sizes.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("jmegatron_grouped_sgemm_wgrad: A [N, K], G [N, P], sizes [E], C [E, K, P]");
  }
  const int64_t n = ad[0], k = ad[1], p = gd[1], groups = cd[0];
  if (gd[0] != n || cd[1] != k || cd[2] != p || sizes.dimensions()[0] != groups) {
    return ffi::Error::InvalidArgument("jmegatron_grouped_sgemm_wgrad: shapes do not match");
  }
  std::vector<int64_t> off;
  if (auto err = Offsets(sizes, n, &off); !err.success()) return err;
  const float* pa = a.typed_data();
  const float* pg = g.typed_data();
  float* pc = c->typed_data();
  struct Task { int64_t e, lo, hi; };  // columns [lo, hi) of group e's K x P block
  std::vector<Task> tasks;
  for (int64_t e = 0; e < groups; ++e)
    for (int64_t lo = 0; lo < std::max<int64_t>(p, 1); lo += kPanel) tasks.push_back({e, lo, std::min(lo + kPanel, p)});
  auto run = [&](int64_t t) {
    const Task& task = tasks[t];
    const int64_t rows = off[task.e + 1] - off[task.e];
    float* out = pc + task.e * k * p + task.lo;
    if (rows == 0 || k == 0 || task.hi <= task.lo) {  // an empty group's gradient is zero
      for (int64_t i = 0; i < k; ++i) std::fill(out + i * p, out + i * p + (task.hi - task.lo), 0.0f);
      return;
    }
    scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, k, task.hi - task.lo, rows, 1.0f,
                      pa + off[task.e] * k, k, pg + off[task.e] * p + task.lo, p, 0.0f, out, p);
  };
  jmegatron::ParallelFor(pool, static_cast<int64_t>(tasks.size()), run);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronGroupedSgemm, GroupedSgemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronGroupedSgemmWgrad, GroupedSgemmWgrad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
