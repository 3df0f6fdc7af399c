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
//
// Every buffer (a, b or g, group_sizes and the result c) is checked for dtype and shape, and
// every size against OpenBLAS's 32-bit int, with an error naming it (checks.h).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cblas.h"
#include "checks.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jmegatron::Expect;
using jmegatron::ExpectRank;

constexpr int64_t kPanel = 128;  // rows (or columns) per task
constexpr char kFwd[] = "jmegatron_grouped_sgemm";
constexpr char kWgrad[] = "jmegatron_grouped_sgemm_wgrad";

// Prefix sums of the group sizes; an error for negative sizes or more rows than n.
ffi::Error Offsets(const char* op, const ffi::AnyBuffer& sizes, int64_t n, std::vector<int64_t>* offsets) {
  const int64_t groups = sizes.dimensions()[0];
  const int32_t* s = sizes.typed_data<int32_t>();
  offsets->assign(groups + 1, 0);
  for (int64_t e = 0; e < groups; ++e) {
    if (s[e] < 0) {
      return ffi::Error::InvalidArgument(std::string(op) + ": group_sizes[" + std::to_string(e) + "] = " +
                                         std::to_string(s[e]) + " is negative");
    }
    (*offsets)[e + 1] = (*offsets)[e] + s[e];
  }
  if ((*offsets)[groups] > n) {
    return ffi::Error::InvalidArgument(std::string(op) + ": group_sizes add up to " +
                                       std::to_string((*offsets)[groups]) + ", more than the " + std::to_string(n) +
                                       " rows of a");
  }
  return ffi::Error::Success();
}

// Checks group_sizes (int32 [groups]) and the result c (float32 `c_shape`), then every size
// and leading dimension OpenBLAS sees (a group has at most n rows) against its 32-bit int;
// fills `off` with the groups' row offsets (Offsets).
ffi::Error CheckGroups(const char* op, const ffi::AnyBuffer& sizes, const ffi::AnyBuffer& c,
                       const std::vector<int64_t>& c_shape, int64_t groups, int64_t n, int64_t k, int64_t p,
                       std::vector<int64_t>* off) {
  if (auto err = Expect(op, "group_sizes", sizes, ffi::DataType::S32, {groups}); err.failure()) return err;
  if (auto err = Expect(op, "c", c, ffi::DataType::F32, c_shape); err.failure()) return err;
  if (auto err = jmegatron::BlasInts(op, {{"N", n}, {"K", k}, {"P", p}}); err.failure()) return err;
  return Offsets(op, sizes, n, off);
}

struct Task {  // rows (or columns) [lo, hi) of group e
  int64_t e, lo, hi;
};

ffi::Error GroupedSgemmBody(ffi::ThreadPool& pool, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                            const ffi::AnyBuffer& sizes, ffi::Result<ffi::AnyBuffer>& c, bool trans_b) {
  if (auto err = ExpectRank(kFwd, "a", a, ffi::DataType::F32, 2, "[N, K]"); err.failure()) return err;
  if (auto err = ExpectRank(kFwd, "b", b, ffi::DataType::F32, 3, trans_b ? "[E, P, K]" : "[E, K, P]");
      err.failure()) {
    return err;
  }
  auto ad = a.dimensions(), bd = b.dimensions();
  const int64_t n = ad[0], k = ad[1], groups = bd[0];
  const int64_t kb = trans_b ? bd[2] : bd[1], p = trans_b ? bd[1] : bd[2];
  if (kb != k) {
    return jmegatron::Mismatch(kFwd, "b", (trans_b ? "float32[E, P, K=" : "float32[E, K=") + std::to_string(k) +
                                              (trans_b ? "]" : ", P]") + " (a's K)",
                               b);
  }
  std::vector<int64_t> off;
  if (auto err = CheckGroups(kFwd, sizes, *c, {n, p}, groups, n, k, p, &off); err.failure()) return err;
  const float* pa = a.typed_data<float>();
  const float* pb = b.typed_data<float>();
  float* pc = c->typed_data<float>();
  std::fill(pc + off[groups] * p, pc + n * p, 0.0f);  // rows outside every group
  if (p == 0) return ffi::Error::Success();
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
  return jmegatron::ParallelFor(kFwd, pool, static_cast<int64_t>(tasks.size()), run);
}

ffi::Error GroupedSgemmWgradBody(ffi::ThreadPool& pool, const ffi::AnyBuffer& a, const ffi::AnyBuffer& g,
                                 const ffi::AnyBuffer& sizes, ffi::Result<ffi::AnyBuffer>& c) {
  if (auto err = ExpectRank(kWgrad, "a", a, ffi::DataType::F32, 2, "[N, K]"); err.failure()) return err;
  auto ad = a.dimensions();
  const int64_t n = ad[0], k = ad[1];
  if (g.element_type() != ffi::DataType::F32 || g.dimensions().size() != 2 || g.dimensions()[0] != n) {
    return jmegatron::Mismatch(kWgrad, "g", "float32[N=" + std::to_string(n) + ", P] (a's rows)", g);
  }
  const int64_t p = g.dimensions()[1];
  if (auto err = ExpectRank(kWgrad, "c", *c, ffi::DataType::F32, 3, "[E, K, P]"); err.failure()) return err;
  const int64_t groups = c->dimensions()[0];
  std::vector<int64_t> off;
  if (auto err = CheckGroups(kWgrad, sizes, *c, {groups, k, p}, groups, n, k, p, &off); err.failure()) return err;
  const float* pa = a.typed_data<float>();
  const float* pg = g.typed_data<float>();
  float* pc = c->typed_data<float>();
  std::vector<Task> tasks;  // columns [lo, hi) of group e's K x P block
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
  return jmegatron::ParallelFor(kWgrad, pool, static_cast<int64_t>(tasks.size()), run);
}

}  // namespace

// The handlers run under jmegatron::Guarded (the vectors above allocate).
// a, b, group_sizes -> c
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronGroupedSgemm, jmegatron::GuardedHandler(kFwd, GroupedSgemmBody),
                              (jmegatron::BufferBinding<3, 1>().Attr<bool>("trans_b")));

// a, g, group_sizes -> c
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronGroupedSgemmWgrad, jmegatron::GuardedHandler(kWgrad, GroupedSgemmWgradBody),
                              (jmegatron::BufferBinding<3, 1>()));
