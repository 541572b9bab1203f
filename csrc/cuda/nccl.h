#pragma once
// NCCL for the CUDA path: the one checking macro for NCCL and CUDA calls, and the world
// communicator, made lazily (at the first CUDA op) from a unique id passed through the job's
// c10d Store. Small groups get no communicator of their own: their collectives are grouped
// ncclSend/ncclRecv between their members over this one (cuda/cuda_engine.cpp).
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <mutex>
#include <string>

#include "common/errors.h"

namespace fastcomm {
namespace nccl {

// Every NCCL and CUDA call goes through FASTCOMM_GPU_CHECK: on failure it raises the project's
// transport error (DistBackendError) with the call, file:line and NCCL's / CUDA's own message.
[[noreturn]] void fail(ncclResult_t r, ncclComm_t comm, const char* expr, const char* file, int line);
[[noreturn]] void fail(cudaError_t r, ncclComm_t comm, const char* expr, const char* file, int line);
inline bool ok(ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; }
inline bool ok(cudaError_t r) { return r == cudaSuccess; }

}  // namespace nccl
}  // namespace fastcomm

// `FASTCOMM_GPU_CHECK(call)`; inside code that owns a communicator, FASTCOMM_GPU_CHECK_COMM
// adds that communicator's ncclGetLastError detail.
#define FASTCOMM_GPU_CHECK_COMM(call, comm)                                          \
  do {                                                                               \
    auto fastcomm_gpu_r_ = (call);                                                   \
    if (!::fastcomm::nccl::ok(fastcomm_gpu_r_))                                      \
      ::fastcomm::nccl::fail(fastcomm_gpu_r_, (comm), #call, __FILE__, __LINE__);    \
  } while (0)
#define FASTCOMM_GPU_CHECK(call) FASTCOMM_GPU_CHECK_COMM(call, nullptr)

namespace fastcomm {
namespace nccl {

class WorldComm {
 public:
  // Collective over the whole world: every rank must get here (its first CUDA op, or
  // fastcomm.init_cuda()). Waits for all ranks through the store for at most `timeout`, so a
  // rank that never issues a CUDA op is an error naming it, not a hang inside NCCL.
  WorldComm(c10d::Store& store, int rank, int world, int device, std::chrono::milliseconds timeout);
  ~WorldComm();

  ncclComm_t get() const { return comm_; }
  int device() const { return device_; }
  // Polled by the watchdog: the communicator's asynchronous error, or ncclSuccess.
  ncclResult_t async_error();
  // Ends every NCCL kernel of this communicator (they may be waiting for a dead peer); the
  // communicator is unusable afterwards. Idempotent; safe from another thread.
  void abort();
  bool aborted() const { return aborted_; }

 private:
  ncclComm_t comm_ = nullptr;
  int device_ = -1;
  std::mutex abort_mu_;
  bool aborted_ = false;
};

}  // namespace nccl
}  // namespace fastcomm
