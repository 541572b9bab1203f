#pragma once
// The engine's CUDA path. Why a separate path and not one more Transport: the CPU path is a
// set of host state machines that a progress loop steps over byte rings; NCCL work is
// enqueued on a CUDA stream and completes on the device, in issue order, signalled by events.
// Sharing the progress loop would put device polling on the CPU hot path and host polling on
// the GPU one. What the two paths share is the group records (ids, rank lists, membership) of
// the engine: a CUDA op on a group is a *virtual* group op over the one world communicator.
//
// How a group op maps onto NCCL: every collective of a small group is one exchange of grouped
// ncclSend/ncclRecv between its members (each member sends its span to every other member),
// followed, for reductions, by a fold in group-rank order done by our own kernel. A batch over
// many groups is ONE ncclGroupStart/End and ONE fused reduction launch. Byte-typed transfers
// make every dtype movable; only the fold knows dtypes.
//
// Stream semantics (as ProcessGroupNCCL): ops run on one internal stream, ordered after the
// caller's current stream; Work.wait() makes the caller's current stream wait (no host block);
// Work.synchronize()/is_completed() look at the op's end event; every tensor is recorded on
// the internal stream so the caching allocator keeps it until the op is done.
//
// Ordering rule, stricter than the CPU path's: NCCL matches sends and receives between two
// ranks in issue order over the whole communicator. Groups that share at most one pair of
// ranks (pairs, ring neighbours, disjoint groups) need nothing more than the per-group order;
// groups sharing two or more ranks must have their CUDA ops issued in the same relative order
// on those ranks. A batch is issued in the order its ops were added.
//
// Faults: a watchdog thread polls each op's end event, NCCL's asynchronous error, the op's
// deadline (init's timeout) and the liveness of same-host peers; on any fault it aborts the
// world communicator (which ends kernels stuck waiting on a dead peer), fails every pending
// op with DistBackendError, and every later CUDA op raises that error. One communicator means
// one fault domain: after a fault no CUDA op works until shutdown() and init() again.
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "algorithms/cuda_reduce.h"
#include "engine/engine.h"
#include "transport/nccl/transport.h"

namespace fastcomm {

class CudaOps;

// One validated CUDA op of a virtual group, not yet issued.
struct CudaOp {
  enum Kind : uint8_t { AllReduce, Broadcast, AllGather, ReduceScatter, Send, Recv };
  Kind kind;
  c10d::OpType type;
  std::vector<int> ranks;  // global ranks of the group; group rank i is ranks[i]
  int me = 0;              // this process's group rank
  at::Tensor in;           // all_reduce / broadcast / send / recv: the tensor; else the input
  at::Tensor out;          // all_gather_into_tensor, reduce_scatter*: the output
  std::vector<at::Tensor> outs, ins;  // list forms (all_gather, reduce_scatter)
  cuda::RedOp redop = cuda::RedOp::Sum;
  int peer = -1;  // broadcast: root group rank; send/recv: peer global rank
  at::Tensor scratch;  // allocated at issue, on the internal stream
};

class CudaWork final : public c10d::Work {
 public:
  CudaWork(std::shared_ptr<CudaOps> owner, int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
           bool capturing);
  ~CudaWork() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override { return outputs_; }
  // Host-blocks until the op has finished on the device (or failed, or timed out).
  void synchronize() override;
  // Makes the caller's current stream wait for the op; with a timeout, also host-blocks up to it.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Watchdog side.
  bool poll_event();  // true once the end event has completed
  void finish(std::exception_ptr error);
  bool finished() const;

 private:
  friend class CudaOps;
  void host_wait(std::chrono::milliseconds timeout);

  std::shared_ptr<CudaOps> owner_;
  std::vector<at::Tensor> outputs_;
  cudaEvent_t end_ = nullptr;
  std::vector<int> peers_;  // global ranks this op talks to (liveness checks)
  std::chrono::steady_clock::time_point deadline_;
  const bool capturing_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class CudaOps final : public EngineExtension, public std::enable_shared_from_this<CudaOps> {
 public:
  // Makes the world communicator on `device` (collective over the world, see WorldComm).
  CudaOps(const EngineOptions& opts, c10d::Store& store, int device);
  ~CudaOps() override;

  // The engine's CUDA path, made on first use. Throws if the engine has no store.
  static std::shared_ptr<CudaOps> get(Engine& e, int device);

  // Local checks; throw TORCH_CHECK-style errors naming rank, group and argument.
  CudaOp prepare_all_reduce(const GroupHandle& g, const at::Tensor& t, c10d::ReduceOp::RedOpType op);
  CudaOp prepare_broadcast(const GroupHandle& g, const at::Tensor& t, int src);
  CudaOp prepare_all_gather(const GroupHandle& g, const std::vector<at::Tensor>& outs, const at::Tensor& in);
  CudaOp prepare_all_gather_into_tensor(const GroupHandle& g, const at::Tensor& out, const at::Tensor& in);
  CudaOp prepare_reduce_scatter(const GroupHandle& g, const at::Tensor& out, const std::vector<at::Tensor>& ins,
                                c10d::ReduceOp::RedOpType op);
  CudaOp prepare_reduce_scatter_tensor(const GroupHandle& g, const at::Tensor& out, const at::Tensor& in,
                                       c10d::ReduceOp::RedOpType op);
  CudaOp prepare_p2p(const GroupHandle& g, const at::Tensor& t, int peer, bool sending);

  // Issues the ops as one NCCL group call plus one fused fold; one Work for all of them.
  // A blocking call (async_op false) returns after making the current stream wait.
  c10::intrusive_ptr<CudaWork> post(std::vector<CudaOp> ops, bool async_op);

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
  void check_common(const GroupHandle& g, const char* api, const at::Tensor& t, const char* arg) const;
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
