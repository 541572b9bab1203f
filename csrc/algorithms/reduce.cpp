#include "algorithms/reduce.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <type_traits>

#include "common/errors.h"

namespace fastcomm {
namespace {

using RedOp = c10d::ReduceOp::RedOpType;

// Target-specific builds of the loops. The bodies are plain elementwise loops (each element
// computed exactly as in the scalar code, so results are bitwise the same on every build); on
// x86-64 a second build with AVX2 runs where the CPU has it (select_reduce_kernels). A cold
// fold of a megabyte (the data just came off a socket or out of another process's cache) took
// 73 us with the baseline SSE2 build and 48 us with AVX2 in a standalone test on the
// development VM.
#if defined(__GNUC__) && defined(__x86_64__)
#define FASTCOMM_HAVE_AVX2_KERNELS 1
#define FASTCOMM_INLINE __attribute__((always_inline)) inline
#else
#define FASTCOMM_INLINE inline
#endif

// Arithmetic type for a storage type: 16-bit floats compute in float.
template <typename T>
struct Acc {
  using type = T;
};
template <>
struct Acc<c10::Half> {
  using type = float;
};
template <>
struct Acc<c10::BFloat16> {
  using type = float;
};

// MIN/MAX propagate NaN like torch.minimum/torch.maximum, so every member gets the same
// answer whichever side the NaN came from.
template <typename A>
FASTCOMM_INLINE A fmin_nan(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return b < a ? b : a;
}
template <typename A>
FASTCOMM_INLINE A fmax_nan(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return b > a ? b : a;
}

// One element of the reduction, in the arithmetic type.
template <RedOp OP, typename A>
FASTCOMM_INLINE A combine(A x, A y) {
  if constexpr (OP == RedOp::SUM || OP == RedOp::AVG) return x + y;
  else if constexpr (OP == RedOp::PRODUCT) return x * y;
  else if constexpr (OP == RedOp::MIN) return fmin_nan<A>(x, y);
  else if constexpr (OP == RedOp::MAX) return fmax_nan<A>(x, y);
  else if constexpr (OP == RedOp::BAND) return x & y;
  else if constexpr (OP == RedOp::BOR) return x | y;
  else return x ^ y;
}

template <typename T, RedOp OP>
FASTCOMM_INLINE void loop(T* __restrict dst, const T* __restrict a, const T* __restrict b, size_t n) {
  using A = typename Acc<T>::type;
  for (size_t i = 0; i < n; ++i)
    dst[i] = static_cast<T>(combine<OP, A>(static_cast<A>(a[i]), static_cast<A>(b[i])));
}

// In-place form kept separate so the compiler sees no aliasing between dst and src.
template <typename T, RedOp OP>
FASTCOMM_INLINE void loop_inplace(T* __restrict dst, const T* __restrict src, size_t n) {
  using A = typename Acc<T>::type;
  for (size_t i = 0; i < n; ++i)
    dst[i] = static_cast<T>(combine<OP, A>(static_cast<A>(dst[i]), static_cast<A>(src[i])));
}

template <typename T, RedOp OP>
void kernel(T* dst, const T* a, const T* b, size_t n) { loop<T, OP>(dst, a, b, n); }
template <typename T, RedOp OP>
void kernel_inplace(T* dst, const T* src, size_t n) { loop_inplace<T, OP>(dst, src, n); }

#ifdef FASTCOMM_HAVE_AVX2_KERNELS
template <typename T, RedOp OP>
__attribute__((target("avx2"))) void kernel_avx2(T* dst, const T* a, const T* b, size_t n) {
  loop<T, OP>(dst, a, b, n);
}
template <typename T, RedOp OP>
__attribute__((target("avx2"))) void kernel_inplace_avx2(T* dst, const T* src, size_t n) {
  loop_inplace<T, OP>(dst, src, n);
}
// Whether the AVX2 build runs; set by select_reduce_kernels() when an engine starts (relaxed:
// it is written before the engine's threads exist, and either answer is correct anyway).
std::atomic<bool> g_avx2{false};
#endif

template <typename T, RedOp OP>
void run(T* d, const T* x, const T* y, size_t n) {
  const bool inplace = (x == nullptr);
#ifdef FASTCOMM_HAVE_AVX2_KERNELS
  if (g_avx2.load(std::memory_order_relaxed)) {
    if (inplace) kernel_inplace_avx2<T, OP>(d, y, n);
    else kernel_avx2<T, OP>(d, x, y, n);
    return;
  }
#endif
  if (inplace) kernel_inplace<T, OP>(d, y, n);
  else kernel<T, OP>(d, x, y, n);
}

template <typename T>
void dispatch_op(void* dst, const void* a, const void* b, size_t n, RedOp op) {
  auto* d = static_cast<T*>(dst);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  switch (op) {
    case RedOp::SUM: return run<T, RedOp::SUM>(d, x, y, n);
    case RedOp::AVG: return run<T, RedOp::AVG>(d, x, y, n);
    case RedOp::PRODUCT: return run<T, RedOp::PRODUCT>(d, x, y, n);
    case RedOp::MIN: return run<T, RedOp::MIN>(d, x, y, n);
    case RedOp::MAX: return run<T, RedOp::MAX>(d, x, y, n);
    default:
      break;
  }
  if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case RedOp::BAND: return run<T, RedOp::BAND>(d, x, y, n);
      case RedOp::BOR: return run<T, RedOp::BOR>(d, x, y, n);
      case RedOp::BXOR: return run<T, RedOp::BXOR>(d, x, y, n);
      default:
        break;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unsupported reduce op reached a kernel");
}

// bool as torch's other backends treat it: SUM and MAX are a logical or, PRODUCT and MIN a
// logical and; on 0/1 bytes these are the bitwise ops.
RedOp bool_op(RedOp op) {
  switch (op) {
    case RedOp::SUM:
    case RedOp::MAX:
      return RedOp::BOR;
    case RedOp::PRODUCT:
    case RedOp::MIN:
      return RedOp::BAND;
    default:
      return op;
  }
}

void dispatch(void* dst, const void* a, const void* b, size_t n, c10::ScalarType dtype, RedOp op) {
  if (n == 0) return;
  switch (dtype) {
    case c10::ScalarType::Float: return dispatch_op<float>(dst, a, b, n, op);
    case c10::ScalarType::Double: return dispatch_op<double>(dst, a, b, n, op);
    case c10::ScalarType::Half: return dispatch_op<c10::Half>(dst, a, b, n, op);
    case c10::ScalarType::BFloat16: return dispatch_op<c10::BFloat16>(dst, a, b, n, op);
    case c10::ScalarType::Int: return dispatch_op<int32_t>(dst, a, b, n, op);
    case c10::ScalarType::Long: return dispatch_op<int64_t>(dst, a, b, n, op);
    case c10::ScalarType::Short: return dispatch_op<int16_t>(dst, a, b, n, op);
    case c10::ScalarType::Char: return dispatch_op<int8_t>(dst, a, b, n, op);
    case c10::ScalarType::Byte: return dispatch_op<uint8_t>(dst, a, b, n, op);
    case c10::ScalarType::Bool: return dispatch_op<uint8_t>(dst, a, b, n, bool_op(op));
    default:
      TORCH_INTERNAL_ASSERT(false, "unsupported dtype reached a kernel");
  }
}

template <typename T>
void divide_impl(void* dst, size_t n, int k) {
  using A = typename Acc<T>::type;
  auto* d = static_cast<T*>(dst);
  const A div = static_cast<A>(k);
  for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(static_cast<A>(d[i]) / div);
}

}  // namespace

void select_reduce_kernels(bool baseline) {
#ifdef FASTCOMM_HAVE_AVX2_KERNELS
  __builtin_cpu_init();  // idempotent; needed only if this ever runs before libgcc's constructor
  g_avx2.store(!baseline && __builtin_cpu_supports("avx2"), std::memory_order_relaxed);
#endif
}

const char* reduce_kernels() {
#ifdef FASTCOMM_HAVE_AVX2_KERNELS
  if (g_avx2.load(std::memory_order_relaxed)) return "avx2";
#endif
  return "baseline";
}

void reduce_into(void* dst, const void* src, size_t n, c10::ScalarType dtype, RedOp op) {
  dispatch(dst, nullptr, src, n, dtype, op);
}

void reduce_to(void* dst, const void* a, const void* b, size_t n, c10::ScalarType dtype,
               RedOp op) {
  dispatch(dst, a, b, n, dtype, op);
}

void divide_by(void* dst, size_t n, c10::ScalarType dtype, int divisor) {
  if (n == 0 || divisor == 1) return;
  switch (dtype) {
    case c10::ScalarType::Float: return divide_impl<float>(dst, n, divisor);
    case c10::ScalarType::Double: return divide_impl<double>(dst, n, divisor);
    case c10::ScalarType::Half: return divide_impl<c10::Half>(dst, n, divisor);
    case c10::ScalarType::BFloat16: return divide_impl<c10::BFloat16>(dst, n, divisor);
    default:
      TORCH_INTERNAL_ASSERT(false, "AVG on a non-floating dtype reached a kernel");
  }
}

bool dtype_supported(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Short:
    case c10::ScalarType::Char:
    case c10::ScalarType::Byte:
    case c10::ScalarType::Bool:
      return true;
    default:
      return false;
  }
}

bool order_independent(c10::ScalarType dtype, RedOp op) {
  return !c10::isFloatingType(dtype) || op == RedOp::MIN || op == RedOp::MAX;
}

}  // namespace fastcomm
