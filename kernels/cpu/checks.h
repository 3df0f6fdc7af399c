// Operand, size and allocation checks shared by the jmegatron CPU kernels.
//
// An FFI handler must never crash the process or throw: every problem it can detect comes
// back to Python as an ffi::Error (a JaxRuntimeError there) whose message names the kernel,
// the buffer or dimension, what was expected and what was given.
//
// * Expect / Mismatch: a buffer's dtype and shape (inputs and results alike: XLA hands a
//   custom call whatever result_shape_dtypes its caller declared).
// * BlasInts: every size or leading dimension a BLAS call sees, checked against the 32-bit
//   int of scipy-openblas32 (`blasint`) before it is narrowed.
// * Allocate: a heap allocation that returns an error when it fails (no std::bad_alloc).
// * Guarded: the body of a handler, with any C++ exception turned into an error.
// * GuardedHandler / BufferBinding: a kernel's handler and the start of its binding, for
//   XLA_FFI_DEFINE_HANDLER_SYMBOL.
#ifndef JMEGATRON_KERNELS_CPU_CHECKS_H_
#define JMEGATRON_KERNELS_CPU_CHECKS_H_

#include <cstdint>
#include <exception>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cblas.h"
#include "xla/ffi/api/ffi.h"

namespace jmegatron {

namespace ffi = xla::ffi;

// The largest size OpenBLAS's (32-bit) int holds.
constexpr int64_t kBlasIntMax = std::numeric_limits<blasint>::max();

inline const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::PRED: return "bool";
    default: return "another dtype";
  }
}

inline std::string Describe(ffi::DataType dtype, ffi::Span<const int64_t> dims) {
  std::string s = std::string(DtypeName(dtype)) + "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline ffi::Error Mismatch(const char* op, const char* name, const std::string& want, const ffi::AnyBuffer& buf) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must be " + want + ", got " +
                                     Describe(buf.element_type(), buf.dimensions()));
}

// Success when `buf` is `dtype` with dimensions `want`, else an error naming `name`.
inline ffi::Error Expect(const char* op, const char* name, const ffi::AnyBuffer& buf, ffi::DataType dtype,
                         const std::vector<int64_t>& want) {
  auto dims = buf.dimensions();
  bool ok = buf.element_type() == dtype && dims.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = dims[i] == want[i];
  if (ok) return ffi::Error::Success();
  return Mismatch(op, name, Describe(dtype, ffi::Span<const int64_t>(want.data(), want.size())), buf);
}

// One buffer of ExpectAll: its name, the buffer, its expected dimensions.
struct Want {
  const char* name;
  const ffi::AnyBuffer* buf;
  std::vector<int64_t> dims;
};

// Success when every buffer of `wants` is `dtype` with its dimensions, else the error of the
// first that is not (Expect).
inline ffi::Error ExpectAll(const char* op, ffi::DataType dtype, const std::vector<Want>& wants) {
  for (const Want& w : wants) {
    if (auto err = Expect(op, w.name, *w.buf, dtype, w.dims); err.failure()) return err;
  }
  return ffi::Error::Success();
}

// Success when `buf` is `dtype` of rank `rank` (any sizes), else an error naming `name`
// with `layout` (e.g. "[M, K]") as the expected form.
inline ffi::Error ExpectRank(const char* op, const char* name, const ffi::AnyBuffer& buf, ffi::DataType dtype,
                             size_t rank, const char* layout) {
  if (buf.element_type() == dtype && buf.dimensions().size() == rank) return ffi::Error::Success();
  return Mismatch(op, name, std::string(DtypeName(dtype)) + layout, buf);
}

// Success when every (name, value) is in [0, 2^31 - 1], the range of scipy-openblas32's
// `blasint`, else an error naming the first dimension that is not: a size is checked here
// before it is narrowed to a BLAS argument.
inline ffi::Error BlasInts(const char* op, std::initializer_list<std::pair<const char*, int64_t>> sizes) {
  for (const auto& [name, value] : sizes) {
    if (value < 0 || value > kBlasIntMax) {
      return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " = " + std::to_string(value) +
                                         " does not fit OpenBLAS's 32-bit int (at most " +
                                         std::to_string(kBlasIntMax) +
                                         "); split the operands (a smaller batch, sequence or hidden size)");
    }
  }
  return ffi::Error::Success();
}

// a * b for sizes a, b >= 0, or INT64_MAX when it overflows (an allocation of that fails).
inline int64_t SatMul(int64_t a, int64_t b) {
  int64_t r;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) return std::numeric_limits<int64_t>::max();
  return r;
}

// *out <- a new T[count] (uninitialised), or an error naming `what` and the bytes asked
// for when the allocation fails (std::nothrow: no exception).
template <typename T>
ffi::Error Allocate(const char* op, const char* what, int64_t count, std::unique_ptr<T[]>* out) {
  const bool too_big = count < 0 || static_cast<uint64_t>(count) > std::numeric_limits<size_t>::max() / sizeof(T);
  T* p = too_big ? nullptr : new (std::nothrow) T[static_cast<size_t>(count)];
  if (p == nullptr && count != 0) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(op) + ": cannot allocate " + what + " (" + std::to_string(count) + " x " +
                          std::to_string(sizeof(T)) + " bytes) of host memory; use smaller operands");
  }
  out->reset(p);
  return ffi::Error::Success();
}

// The error for an exception that reached a kernel's top level or one of its pool tasks.
inline ffi::Error FromException(const char* op, std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(op) + ": out of host memory (std::bad_alloc); use smaller operands");
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(std::string(op) + ": " + ex.what());
  } catch (...) {
    return ffi::Error::Internal(std::string(op) + ": an unknown C++ exception");
  }
}

// body() (returning ffi::Error), with any exception it throws returned as an error instead.
template <typename Body>
ffi::Error Guarded(const char* op, Body&& body) noexcept {
  try {
    return body();
  } catch (...) {
    return FromException(op, std::current_exception());
  }
}

// The handler of a kernel whose checks and work are `body(pool, operands..., results...,
// attributes...)` (taking them by reference): it takes what the binding decodes, in the same
// order, and runs body under Guarded, so that no exception leaves it.
template <typename Body>
auto GuardedHandler(const char* op, Body body) {
  return [op, body](auto... decoded) noexcept -> ffi::Error {
    return Guarded(op, [&] { return body(decoded...); });
  };
}

// ffi::Ffi::Bind() with XLA's intra-op thread pool, then `kArgs` ffi::AnyBuffer operands,
// then `kRets` ffi::AnyBuffer results; the caller appends the named attributes. (A binding
// cannot be copied or moved, so each step chains on the previous one's temporary.)
template <int kArgs, int kRets>
auto BufferBinding() {
  if constexpr (kRets > 0) {
    return BufferBinding<kArgs, kRets - 1>().template Ret<ffi::AnyBuffer>();
  } else if constexpr (kArgs > 0) {
    return BufferBinding<kArgs - 1, 0>().template Arg<ffi::AnyBuffer>();
  } else {
    return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>();
  }
}

// BufferBinding<kArgs, kRets>() then the attributes `names` (in order) of the types of the
// std::tuple `Attrs`.
template <int kArgs, int kRets, typename Attrs, size_t kCount = std::tuple_size_v<Attrs>>
auto AttrBinding(const char* const* names) {
  if constexpr (kCount == 0) {
    return BufferBinding<kArgs, kRets>();
  } else {
    return AttrBinding<kArgs, kRets, Attrs, kCount - 1>(names).template Attr<std::tuple_element_t<kCount - 1, Attrs>>(
        names[kCount - 1]);
  }
}

}  // namespace jmegatron

#endif  // JMEGATRON_KERNELS_CPU_CHECKS_H_
