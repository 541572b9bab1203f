#pragma once
// The device engine for CUDA tensors (engine/device.h), made at the first CUDA op. A CUDA op
// of a group is a virtual group op over one world NCCL communicator: every collective of a
// small group is one exchange of grouped ncclSend/ncclRecv between its members, followed, for
// reductions, by a fold in group-rank order by our own kernel (cuda/reduce.cu). A batch over
// many groups is ONE ncclGroupStart/End and ONE fused fold. Byte-typed transfers make every
// dtype movable; only the fold knows dtypes.
//
// Streams (as ProcessGroupNCCL): ops run on one internal stream, ordered after the caller's
// current stream; every tensor is recorded on it so the caching allocator keeps it until the
// op is done. Ordering: NCCL matches sends and receives between two ranks in issue order over
// the whole communicator, so groups sharing two or more ranks need their CUDA ops issued in
// the same relative order on those ranks.
//
// Faults: a watchdog thread polls each op's end event, NCCL's asynchronous error, the op's
// deadline and the liveness of same-host peers; on a fault it aborts the communicator, fails
// every pending op with DistBackendError, and every later CUDA op raises that error until
// shutdown() and init() again.
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda/cuda_work.h"
#include "cuda/nccl.h"
#include "engine/device.h"

namespace fastcomm {

class CudaEngine final : public DeviceEngine, public std::enable_shared_from_this<CudaEngine> {
 public:
  // Makes the world communicator on `device` (collective over the world, see WorldComm).
  CudaEngine(const EngineOptions& opts, c10d::Store& store, int device);
  ~CudaEngine() override;

  c10::intrusive_ptr<Work> post(std::vector<DeviceOp> ops, bool async_op) override;
  void shutdown() override;

  int device() const { return device_; }
  const c10::cuda::CUDAStream& stream() const { return stream_; }
  int rank() const { return rank_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void raise_if_broken();
  std::exception_ptr broken() const;

  cudaEvent_t take_event();
  void give_event(cudaEvent_t e);

 private:
  void watchdog_main();
  void fail_all(const std::string& why);

  const int rank_;
  const int world_;
  const int device_;
  const std::chrono::milliseconds timeout_;
  std::vector<int> host_of_;
  std::vector<int64_t> pids_;
  std::unique_ptr<nccl::WorldComm> comm_;
  c10::cuda::CUDAStream stream_;
  cudaEvent_t start_ = nullptr;

  std::mutex post_mu_;  // one issuer at a time: NCCL calls on a communicator are serialized

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<CudaWork>> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::exception_ptr broken_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace fastcomm
