// Float32 GEMM for XLA's CPU backend as an XLA FFI custom call (jmegatron_sgemm).
//
// C[M, N] = op(A) @ op(B), row-major, op = identity or transpose (attributes trans_a,
// trans_b). The transposes are BLAS flags, not copies: the weight gradient x^T g and
// the input gradient g W^T read their operands in place (docs/PERFORMANCE.md).
//
// The product is computed by OpenBLAS (scipy-openblas32, single-threaded calls) on
// XLA's own intra-op thread pool: C is cut into one panel per pool thread (rows when
// M >= N, else columns), run by jmegatron::ParallelFor (parallel.h).
#include <algorithm>
#include <cstdint>

#include "cblas.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Sgemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                 ffi::ResultBuffer<ffi::F32> c, bool trans_a, bool trans_b) {
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  auto cd = c->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || cd.size() != 2) {
    return ffi::Error::InvalidArgument("jmegatron_sgemm: operands must be rank 2");
  }
  const int64_t m = trans_a ? ad[1] : ad[0];
  const int64_t k = trans_a ? ad[0] : ad[1];
  const int64_t kb = trans_b ? bd[1] : bd[0];
  const int64_t n = trans_b ? bd[0] : bd[1];
  if (k != kb || cd[0] != m || cd[1] != n) {
    return ffi::Error::InvalidArgument("jmegatron_sgemm: shapes do not match");
  }
  const float* pa = a.typed_data();
  const float* pb = b.typed_data();
  float* pc = c->typed_data();
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
  jmegatron::ParallelFor(pool, parts, run);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronSgemm, Sgemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));

extern "C" void JmegatronBlasInit() { scipy_openblas_set_num_threads(1); }
