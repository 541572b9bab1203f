#include "cuda/cuda_work.h"

#include <ATen/core/jit_type.h>
#include <c10/cuda/CUDAGuard.h>

#include <thread>

#include "common/errors.h"
#include "cuda/cuda_engine.h"
#include "cuda/nccl.h"

namespace fastcomm {

CudaWork::CudaWork(std::shared_ptr<CudaEngine> owner, int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
                   bool capturing)
    : Work(nullptr, rank, type, std::move(outputs), 1, true), owner_(std::move(owner)), capturing_(capturing) {}

CudaWork::~CudaWork() {
  if (end_ != nullptr) owner_->give_event(end_);
}

bool CudaWork::poll_event() {
  const cudaError_t r = cudaEventQuery(end_);
  if (r == cudaErrorNotReady) return false;
  FASTCOMM_GPU_CHECK(r);
  return true;
}

bool CudaWork::isCompleted() {
  if (done()) return true;
  if (capturing_) return false;  // a captured op runs when the graph is replayed, not now
  if (auto b = owner_->broken()) {
    settle(b, true);
    return true;
  }
  if (poll_event()) {
    settle(nullptr, true);
    return true;
  }
  return false;
}

bool CudaWork::wait(std::chrono::milliseconds timeout) {
  if (auto e = exception()) std::rethrow_exception(e);
  owner_->raise_if_broken();
  c10::cuda::CUDAGuard dg((c10::DeviceIndex)owner_->device());
  FASTCOMM_GPU_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream().stream(), end_, 0));
  if (timeout != kNoTimeout) host_wait(timeout);
  return true;
}

void CudaWork::synchronize() { host_wait(owner_->timeout()); }

void CudaWork::host_wait(std::chrono::milliseconds timeout) {
  TORCH_CHECK(!capturing_, "fastcomm: rank ", owner_->rank(),
              ": cannot host-wait for an op captured in a CUDA graph; it runs when the graph is replayed");
  const auto start = std::chrono::steady_clock::now();
  for (int spins = 0;; ++spins) {
    if (isCompleted()) {
      rethrow_if_failed();
      return;
    }
    if (std::chrono::steady_clock::now() - start > timeout)
      throw_comm_error("fastcomm: rank " + std::to_string(owner_->rank()) + ": CUDA op not finished after " +
                       std::to_string(timeout.count()) + " ms (host wait timed out)");
    if (spins < 200) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

c10::intrusive_ptr<c10::ivalue::Future> CudaWork::getFuture() {
  std::lock_guard<std::mutex> lk(mutex_);
  if (!future_) {
    // Completed in stream order, as ProcessGroupNCCL does: consumers' streams wait for an event
    // recorded on the internal stream after this op.
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()),
        std::vector<c10::Device>{c10::Device(c10::kCUDA, (c10::DeviceIndex)owner_->device())});
    if (exception_) {
      future_->setError(exception_);
    } else {
      c10::cuda::CUDAStreamGuard g(owner_->stream());
      future_->markCompleted(c10::IValue(outputs_));
    }
  }
  return future_;
}

}  // namespace fastcomm
