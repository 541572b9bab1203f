#pragma once
// fastcomm as a torch.distributed backend: a c10d::Backend over one engine group. Every op maps
// torch's arguments onto the engine's requests (algorithms/request.h) and returns the engine's
// own Work; no collective is implemented here. torch passes group ranks (rootRank, dstRank,
// srcRank), translated through the group's sorted rank list. torch calls in with the GIL
// released, and nothing here touches Python. Ops not overridden raise torch's usual
// "Backend fastcomm does not support <op>".
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace pybind11 {
class module_;
}

namespace fastcomm {

class FastcommBackend final : public c10d::Backend {
 public:
  // `group` is the engine group over `global_ranks` (sorted; this process is a member).
  // `owns_engine`: this backend made the engine (the world group of init_process_group), so
  // its shutdown() / abort() shut the engine down too.
  FastcommBackend(std::shared_ptr<Engine> engine, GroupHandle group, bool owns_engine);

  const std::string getBackendName() const override { return "fastcomm"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  // outputs[r][i]: group rank r's inputs[i] (torch's all_gather_coalesced layout).
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  // dist.recv / dist.irecv without src: the first matching message from any member; the Work's
  // sourceRank() is the sender's group rank.
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  void shutdown() override;
  void abort() override;

  // Sequence numbers, which torch's debug wrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL) compares
  // across members before each collective: the count of collectives issued on this group. Every
  // member counts from 0 when it makes the group, so setting one needs no agreement.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return collectives_.load(); }

  const GroupHandle& group() const { return group_; }
  bool owns_engine() const { return owns_engine_; }

 private:
  // Checks and posts the requests as one engine post; a blocking call (asyncOp false) also
  // waits for them here, so torch's following Work.wait() finds them done (and raises).
  c10::intrusive_ptr<c10d::Work> run(std::vector<OpRequest> reqs, bool async_op);
  c10::intrusive_ptr<c10d::Work> run(OpRequest req, bool async_op);
  // Global rank of group rank `group_rank` (an argument named `arg` of op `api`).
  int global_rank(int64_t group_rank, const char* api, const char* arg) const;
  const at::Tensor& single(const std::vector<at::Tensor>& v, const char* api, const char* arg) const;
  // The one list of a gather's outputs or a scatter's inputs; torch passes none on the members
  // other than the root (or one empty list).
  std::vector<at::Tensor> root_list(const std::vector<std::vector<at::Tensor>>& v, const char* api,
                                    const char* arg) const;

  std::shared_ptr<Engine> engine_;
  GroupHandle group_;
  const bool owns_engine_;
  std::atomic<uint64_t> collectives_{0};  // collectives posted (send/recv are not counted)
};

// Adds the backend class to the `_C` module (as `_C.FastcommBackend`, a subclass of torch's c10d Backend).
void register_backend_bindings(pybind11::module_& m);

}  // namespace fastcomm
