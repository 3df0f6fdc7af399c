// jmegatron_selftest: an XLA FFI custom call for tests/test_kernel_hardening.py only, to show
// that the kernels' failure paths (parallel.h, checks.h) reach Python as errors and leave the
// process running, without needing the memory that a real failure would take.
//
// x float32 [n] -> y float32 [n], by attribute `mode`:
//   0: y = 2 x, one task per element on XLA's pool, each checking its worker id is in range;
//   1: as 0, but task 5 throws std::bad_alloc (an allocation failing inside a pool task);
//   2: as 0, but task 5 throws std::runtime_error;
//   3: allocates `count` floats before dispatching, as the attention kernels' scratch
//      (count = 2^62: the allocation fails and the call returns ResourceExhausted).
#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "checks.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr char kOp[] = "jmegatron_selftest";

ffi::Error SelfTestBody(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& y, int64_t mode,
                        int64_t count) {
  if (auto err = jmegatron::ExpectRank(kOp, "x", x, ffi::DataType::F32, 1, "[n]"); err.failure()) return err;
  const int64_t n = x.dimensions()[0];
  if (auto err = jmegatron::Expect(kOp, "y", *y, ffi::DataType::F32, {n}); err.failure()) return err;
  std::unique_ptr<float[]> scratch;
  if (mode == 3) {
    if (auto err = jmegatron::Allocate(kOp, "the selftest scratch", count, &scratch); err.failure()) return err;
  }
  const int64_t workers = jmegatron::Workers(pool, n);
  const float* in = x.typed_data<float>();
  float* out = y->typed_data<float>();
  auto task = [&](int64_t i, int64_t worker) {
    if (worker < 0 || worker >= workers) throw std::logic_error("worker id out of range");
    if (i == 5 && mode == 1) throw std::bad_alloc();
    if (i == 5 && mode == 2) throw std::runtime_error("selftest task 5 failed");
    out[i] = 2.0f * in[i];
  };
  return jmegatron::ParallelFor(kOp, pool, n, task);
}

}  // namespace

// x -> y
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmegatronSelfTest, jmegatron::GuardedHandler(kOp, SelfTestBody),
                              (jmegatron::BufferBinding<1, 1>().Attr<int64_t>("mode").Attr<int64_t>("count")));
