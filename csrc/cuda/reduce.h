#pragma once
// The device half of the reductions of the NCCL path: after a batch's grouped send/recv has
// delivered every member's contribution into scratch, ONE launch folds all of the batch's
// reductions (any groups, dtypes, ops). Like the CPU path (algorithms/reduce.cpp), values are
// folded in group-rank order, so every member of a group gets bit-identical results.
//
// Plain CUDA runtime types only: this header is shared by nvcc and the host compiler, and
// keeping torch out of the .cu keeps its compile (CI builds it on every run) short.
#include <cuda_runtime_api.h>

#include <cstdint>

namespace fastcomm {
namespace cuda {

enum class DType : int8_t { F16, BF16, F32, F64, I8, U8, I16, I32, I64 };
enum class RedOp : int8_t { Sum, Avg, Product, Min, Max };

struct ReduceJob {
  void* dst;            // numel results
  const void* own;      // this member's contribution (may equal dst)
  const void* scratch;  // (n - 1) * numel: the other members' contributions, in group-rank order
  int64_t numel;
  int32_t n;   // group size
  int32_t me;  // this member's group rank: own sits at position `me` in the fold
  DType dtype;
  RedOp op;
};

// Jobs passed by value as the kernel's parameter (no host->device copy, so the launch is legal
// inside CUDA graph capture); larger batches take ceil(count / kMaxJobsPerLaunch) launches.
constexpr int kMaxJobsPerLaunch = 64;

// Enqueues the fold of `count` jobs on `stream`; returns the launch's error.
cudaError_t launch_fused_reduce(const ReduceJob* jobs, int count, cudaStream_t stream);

// One block that copies `bytes` from src to dst (or folds one job), then stores `value` to
// `*flag` (a word in mapped host memory: an IPC link's flag) once every thread's writes are
// visible system-wide: a copy and cuStreamWriteValue32 in one entry on the stream, for the
// small chunks of an IPC link (device/ipc_link.h). One block, so meant for small sizes.
cudaError_t launch_copy_flag(void* dst, const void* src, size_t bytes, uint32_t* flag, uint32_t value,
                             cudaStream_t stream);
cudaError_t launch_fold_flag(const ReduceJob& job, uint32_t* flag, uint32_t value, cudaStream_t stream);
// Loads this file's kernels now (CUDA loads kernels lazily, at their first launch, by default;
// a load inside an enqueue may wait for the device while its work waits for a peer).
cudaError_t preload_kernels();

// Enqueues p[i] /= n over `numel` elements of a floating `dtype` (half types in float): the end
// of an AVG that NCCL summed.
cudaError_t launch_divide(void* p, int64_t numel, DType dtype, int32_t n, cudaStream_t stream);

}  // namespace cuda
}  // namespace fastcomm
