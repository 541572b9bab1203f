#pragma once
// The Work of a CUDA op (engine/work.h's family), with torch's stream semantics as
// ProcessGroupNCCL has them: wait() makes the caller's current stream wait for the op's end
// event (no host block), synchronize() and is_completed() look at that event, and the Future
// is CUDA-aware. The watchdog (cuda/cuda_engine.cpp) settles it.
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <vector>

#include "engine/work.h"

namespace fastcomm {

class CudaEngine;

class CudaWork final : public Work {
 public:
  CudaWork(std::shared_ptr<CudaEngine> owner, int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
           bool capturing);
  ~CudaWork() override;

  bool isCompleted() override;
  // Host-blocks until the op has finished on the device (or failed, or timed out).
  void synchronize() override;
  // Makes the caller's current stream wait for the op; with a timeout, also host-blocks up to it.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  bool on_device() const override { return true; }

  // Watchdog side: true once the end event has completed.
  bool poll_event();

 private:
  friend class CudaEngine;
  void host_wait(std::chrono::milliseconds timeout);

  std::shared_ptr<CudaEngine> owner_;
  cudaEvent_t end_ = nullptr;
  std::vector<int> peers_;  // global ranks this op talks to (liveness checks)
  std::chrono::steady_clock::time_point deadline_;
  const bool capturing_;
};

}  // namespace fastcomm
