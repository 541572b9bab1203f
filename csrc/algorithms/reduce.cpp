#include "algorithms/reduce.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/errors.h"

namespace fastcomm {
namespace {

using RedOp = c10d::ReduceOp::RedOpType;

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
inline A fmin_nan(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return b < a ? b : a;
}
template <typename A>
inline A fmax_nan(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return b > a ? b : a;
}

template <typename T, RedOp OP>
void kernel(T* __restrict dst, const T* __restrict a, const T* __restrict b, size_t n) {
  using A = typename Acc<T>::type;
  for (size_t i = 0; i < n; ++i) {
    const A x = static_cast<A>(a[i]);
    const A y = static_cast<A>(b[i]);
    A r;
    if constexpr (OP == RedOp::SUM || OP == RedOp::AVG) r = x + y;
    else if constexpr (OP == RedOp::PRODUCT) r = x * y;
    else if constexpr (OP == RedOp::MIN) r = fmin_nan<A>(x, y);
    else r = fmax_nan<A>(x, y);
    dst[i] = static_cast<T>(r);
  }
}

// In-place form kept separate so the compiler sees no aliasing between dst and src.
template <typename T, RedOp OP>
void kernel_inplace(T* __restrict dst, const T* __restrict src, size_t n) {
  using A = typename Acc<T>::type;
  for (size_t i = 0; i < n; ++i) {
    const A x = static_cast<A>(dst[i]);
    const A y = static_cast<A>(src[i]);
    A r;
    if constexpr (OP == RedOp::SUM || OP == RedOp::AVG) r = x + y;
    else if constexpr (OP == RedOp::PRODUCT) r = x * y;
    else if constexpr (OP == RedOp::MIN) r = fmin_nan<A>(x, y);
    else r = fmax_nan<A>(x, y);
    dst[i] = static_cast<T>(r);
  }
}

template <typename T>
void dispatch_op(void* dst, const void* a, const void* b, size_t n, RedOp op) {
  auto* d = static_cast<T*>(dst);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  const bool inplace = (a == nullptr);
  switch (op) {
#define FASTCOMM_OP_CASE(O)                                  \
  case RedOp::O:                                             \
    if (inplace) kernel_inplace<T, RedOp::O>(d, y, n);      \
    else kernel<T, RedOp::O>(d, x, y, n);                    \
    return;
    FASTCOMM_OP_CASE(SUM)
    FASTCOMM_OP_CASE(AVG)
    FASTCOMM_OP_CASE(PRODUCT)
    FASTCOMM_OP_CASE(MIN)
    FASTCOMM_OP_CASE(MAX)
#undef FASTCOMM_OP_CASE
    default:
      TORCH_INTERNAL_ASSERT(false, "unsupported reduce op reached a kernel");
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
      return true;
    default:
      return false;
  }
}

bool order_independent(c10::ScalarType dtype, RedOp op) {
  return !c10::isFloatingType(dtype) || op == RedOp::MIN || op == RedOp::MAX;
}

}  // namespace fastcomm
