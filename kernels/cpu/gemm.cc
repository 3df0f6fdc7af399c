// Float32 GEMM for XLA's CPU backend as an XLA FFI custom call (jmegatron_sgemm).
//
// C[M, N] = op(A) @ op(B), row-major, op = identity or transpose (attributes trans_a,
// trans_b). The transposes are BLAS flags, not copies: the weight gradient x^T g and
// the input gradient g W^T read their operands in place (docs/PERFORMANCE.md).
//
// The product is computed by OpenBLAS (scipy-openblas32, single-threaded calls) on
// XLA's own intra-op thread pool: C is cut into one panel per pool thread (rows when
// M >= N, else columns), run by jmegatron::ParallelFor (parallel.h).
//
// Every buffer (a, b and the result c) is checked for dtype and shape, and every size
// against OpenBLAS's 32-bit int, with an error naming it (checks.h).
#include <algorithm>
#include <cstdint>
#include <string>

#include "cblas.h"
#include "checks.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr char kOp[] = "jmegatron_sgemm";

ffi::Error SgemmBody(ffi::ThreadPool& pool, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                     ffi::Result<ffi::AnyBuffer>& c, bool trans_a, bool trans_b) {
  using jmegatron::Expect;
  using jmegatron::ExpectRank;
  if (auto err = ExpectRank(kOp, "a", a, ffi::DataType::F32, 2, trans_a ? "[K, M]" : "[M, K]"); err.failure()) {
    return err;
  }
  if (auto err = ExpectRank(kOp, "b", b, ffi::DataType::F32, 2, trans_b ? "[N, K]" : "[K, N]"); err.failure()) {
    return err;
  }
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  const int64_t m = trans_a ? ad[1] : ad[0];
  const int64_t k = trans_a ? ad[0] : ad[1];
  const int64_t kb = trans_b ? bd[1] : bd[0];
  const int64_t n = trans_b ? bd[0] : bd[1];
  if (k != kb) {
    return jmegatron::Mismatch(kOp, "b", std::string("float32") + (trans_b ? "[N, K=" : "[K=") + std::to_string(k) +
                                             (trans_b ? "]" : ", N]") + " (a's contracting size)",
                               b);
  }
  if (auto err = Expect(kOp, "c", *c, ffi::DataType::F32, {m, n}); err.failure()) return err;
  // Every size and leading dimension OpenBLAS sees (a panel is at most m rows or n columns).
  if (auto err = jmegatron::BlasInts(kOp, {{"M", m}, {"N", n}, {"K", k}, {"a's row length (lda)", ad[1]},
                                           {"b's row length (ldb)", bd[1]}});
      err.failure()) {
    return err;
  }
  const float* pa = a.typed_data<float>();
  const float* pb = b.typed_data<float>();
  float* pc = c->typed_data<float>();
  const int64_t lda = ad[1], ldb = bd[1], ldc = n;
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(pc, pc + m * n, 0.0f);
    return ffi::Error::Success();
  }
  const auto ta = trans_a ? CblasTrans : CblasNoTrans;
  const auto tb = trans_b ? CblasTrans : CblasNoTrans;
  const bool split_rows = m >= n;
  const int64_t extent = split_rows ? m : n;
  // Panels of at least 64 rows/columns, one per thread.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, extent / 64));
  auto run = [=](int64_t p) {
    const int64_t lo = extent * p / parts, hi = extent * (p + 1) / parts;
    if (split_rows) {
      const float* a0 = trans_a ? pa + lo : pa + lo * lda;
      scipy_cblas_sgemm(CblasRowMajor, ta, tb, hi - lo, n, k, 1.0f, a0, lda, pb, ldb, 0.0f,
                        pc + lo * ldc, ldc);
    } else {
      const float* b0 = trans_b ? pb + lo * ldb : pb + lo;
      scipy_cblas_sgemm(CblasRowMajor, ta, tb, m, hi - lo, k, 1.0f, pa, lda, b0, ldb, 0.0f,
                        pc + lo, ldc);
    }
  };
  return jmegatron::ParallelFor(kOp, pool, parts, run);
}

}  // namespace

// a, b -> c
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronSgemm, jmegatron::GuardedHandler(kOp, SgemmBody),
                              (jmegatron::BufferBinding<2, 1>().Attr<bool>("trans_a").Attr<bool>("trans_b")));

extern "C" void JmegatronBlasInit() { scipy_openblas_set_num_threads(1); }

// The narrowing check of jmegatron::BlasInts for the tests (a 2^31-element operand would
// need 8 GiB): 1 and an empty `message` when `value` fits OpenBLAS's int, else 0 and the
// error message (cut to `capacity` - 1 characters).
extern "C" int JmegatronCheckBlasInt(const char* name, int64_t value, char* message, int64_t capacity) {
  const ffi::Error err = jmegatron::BlasInts("jmegatron_check_blas_int", {{name, value}});
  if (capacity > 0) {
    const std::string& text = err.message();
    const size_t len = std::min<size_t>(text.size(), static_cast<size_t>(capacity - 1));
    std::copy(text.begin(), text.begin() + len, message);
    message[len] = '\0';
  }
  return err.success() ? 1 : 0;
}
