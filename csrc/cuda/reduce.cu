#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/reduce.h"

namespace fastcomm {
namespace cuda {
namespace {

struct JobBatch {
  int count;
  ReduceJob jobs[kMaxJobsPerLaunch];
};
static_assert(sizeof(JobBatch) <= 4096, "kernel parameters must fit the portable 4 KiB limit");

// Half types fold in float, like torch's CUDA reductions.
template <typename T> struct Acc { using type = T; };
template <> struct Acc<__half> { using type = float; };
template <> struct Acc<__nv_bfloat16> { using type = float; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type load(const T* p, int64_t i) {
  return static_cast<typename Acc<T>::type>(p[i]);
}
template <> __device__ __forceinline__ float load<__half>(const __half* p, int64_t i) { return __half2float(p[i]); }
template <> __device__ __forceinline__ float load<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
template <typename T> __device__ __forceinline__ void store(T* p, int64_t i, typename Acc<T>::type v) {
  p[i] = static_cast<T>(v);
}
template <> __device__ __forceinline__ void store<__half>(__half* p, int64_t i, float v) { p[i] = __float2half(v); }
template <> __device__ __forceinline__ void store<__nv_bfloat16>(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16(v);
}

// MIN and MAX propagate NaN, as torch.minimum/maximum do: a comparison with NaN is false, so
// `b < a ? b : a` alone would keep whichever operand came first.
template <typename A> __device__ __forceinline__ bool is_nan(A) { return false; }
template <> __device__ __forceinline__ bool is_nan<float>(float v) { return isnan(v); }
template <> __device__ __forceinline__ bool is_nan<double>(double v) { return isnan(v); }

template <typename A> __device__ __forceinline__ A combine(RedOp op, A a, A b) {
  switch (op) {
    case RedOp::Product: return a * b;
    case RedOp::Min: return is_nan(a) ? a : (is_nan(b) || b < a) ? b : a;
    case RedOp::Max: return is_nan(a) ? a : (is_nan(b) || a < b) ? b : a;
    default: return a + b;  // Sum, Avg
  }
}

template <typename T>
__device__ void fold(const ReduceJob& j) {
  using A = typename Acc<T>::type;
  const T* own = static_cast<const T*>(j.own);
  const T* scratch = static_cast<const T*>(j.scratch);
  T* dst = static_cast<T*>(j.dst);
  const int64_t stride = (int64_t)blockDim.x * gridDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < j.numel; i += stride) {
    A acc = j.me == 0 ? load(own, i) : load(scratch, i);
    for (int k = 1; k < j.n; ++k) {
      const A v = k == j.me ? load(own, i) : load(scratch, (int64_t)(k < j.me ? k : k - 1) * j.numel + i);
      acc = combine(j.op, acc, v);
    }
    if (j.op == RedOp::Avg) acc = acc / static_cast<A>(j.n);
    store(dst, i, acc);
  }
}

__device__ void fold_any(const ReduceJob& j) {
  switch (j.dtype) {
    case DType::F16: fold<__half>(j); break;
    case DType::BF16: fold<__nv_bfloat16>(j); break;
    case DType::F32: fold<float>(j); break;
    case DType::F64: fold<double>(j); break;
    case DType::I8: fold<int8_t>(j); break;
    case DType::U8: fold<uint8_t>(j); break;
    case DType::I16: fold<int16_t>(j); break;
    case DType::I32: fold<int32_t>(j); break;
    case DType::I64: fold<int64_t>(j); break;
  }
}

__global__ void fused_reduce(JobBatch b) {
  const ReduceJob& j = b.jobs[blockIdx.y];
  if ((int64_t)blockIdx.x * blockDim.x >= j.numel) return;
  fold_any(j);
}

// The block meets (every thread's loads and stores of the chunk done), then one thread fences at
// system scope, cumulatively over what the barrier ordered before it, and stores the flag:
// whoever sees the flag (the peer's stream waiting on it) sees every store before it, and no
// load of the chunk comes after it.
__device__ __forceinline__ void store_flag_after_block(uint32_t* flag, uint32_t value) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    *reinterpret_cast<volatile uint32_t*>(flag) = value;
  }
}

__global__ void copy_then_flag(uint8_t* dst, const uint8_t* src, size_t n, uint32_t* flag, uint32_t value) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const size_t n16 = n / 16;
    for (size_t i = threadIdx.x; i < n16; i += blockDim.x)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    for (size_t i = n16 * 16 + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  } else {
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }
  store_flag_after_block(flag, value);
}

__global__ void fold_then_flag(ReduceJob j, uint32_t* flag, uint32_t value) {
  fold_any(j);
  store_flag_after_block(flag, value);
}

constexpr int kThreads = 256;
constexpr int kFlagThreads = 512;  // the one block of copy_then_flag / fold_then_flag

// Enough blocks to cover `numel` once, capped: the kernels' loops stride over the rest.
unsigned blocks_for(int64_t numel) {
  const int64_t want = (numel + kThreads - 1) / kThreads;
  return (unsigned)(want < 1024 ? want : 1024);
}

template <typename T>
__global__ void divide(T* p, int64_t numel, int32_t n) {
  using A = typename Acc<T>::type;
  const int64_t stride = (int64_t)blockDim.x * gridDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride)
    store(p, i, load(p, i) / static_cast<A>(n));
}

}  // namespace

cudaError_t launch_divide(void* p, int64_t numel, DType dtype, int32_t n, cudaStream_t stream) {
  if (numel <= 0) return cudaSuccess;
  const unsigned blocks = blocks_for(numel);
  switch (dtype) {
    case DType::F16: divide<<<blocks, kThreads, 0, stream>>>(static_cast<__half*>(p), numel, n); break;
    case DType::BF16: divide<<<blocks, kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(p), numel, n); break;
    case DType::F32: divide<<<blocks, kThreads, 0, stream>>>(static_cast<float*>(p), numel, n); break;
    case DType::F64: divide<<<blocks, kThreads, 0, stream>>>(static_cast<double*>(p), numel, n); break;
    default: return cudaErrorInvalidValue;  // AVG takes floating dtypes only
  }
  return cudaGetLastError();
}

cudaError_t launch_copy_flag(void* dst, const void* src, size_t bytes, uint32_t* flag, uint32_t value,
                             cudaStream_t stream) {
  copy_then_flag<<<1, kFlagThreads, 0, stream>>>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), bytes,
                                                 flag, value);
  return cudaGetLastError();
}

cudaError_t launch_fold_flag(const ReduceJob& job, uint32_t* flag, uint32_t value, cudaStream_t stream) {
  fold_then_flag<<<1, kFlagThreads, 0, stream>>>(job, flag, value);
  return cudaGetLastError();
}

cudaError_t preload_kernels() {
  cudaFuncAttributes a;
  for (const void* f : {(const void*)copy_then_flag, (const void*)fold_then_flag, (const void*)fused_reduce,
                        (const void*)divide<__half>, (const void*)divide<__nv_bfloat16>, (const void*)divide<float>,
                        (const void*)divide<double>})
    if (cudaError_t e = cudaFuncGetAttributes(&a, f)) return e;
  return cudaSuccess;
}

cudaError_t launch_fused_reduce(const ReduceJob* jobs, int count, cudaStream_t stream) {
  for (int base = 0; base < count; base += kMaxJobsPerLaunch) {
    JobBatch b;
    b.count = count - base < kMaxJobsPerLaunch ? count - base : kMaxJobsPerLaunch;
    int64_t most = 1;
    for (int i = 0; i < b.count; ++i) {
      b.jobs[i] = jobs[base + i];
      if (b.jobs[i].numel > most) most = b.jobs[i].numel;
    }
    dim3 grid(blocks_for(most), (unsigned)b.count);  // sized for the largest job
    fused_reduce<<<grid, kThreads, 0, stream>>>(b);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace fastcomm
