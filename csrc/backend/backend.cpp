#include "backend/backend.h"

#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <utility>

namespace py = pybind11;

namespace fastcomm {

FastcommBackend::FastcommBackend(std::shared_ptr<Engine> engine, GroupHandle group, bool owns_engine)
    : c10d::Backend(group.rank, (int)group.ranks.size()),
      engine_(std::move(engine)),
      group_(std::move(group)),
      owns_engine_(owns_engine) {
  TORCH_CHECK_VALUE(engine_ != nullptr, "fastcomm backend: no engine");
  TORCH_CHECK_VALUE(group_.state != nullptr, "fastcomm backend: rank ", engine_->rank(),
                    " is not a member of group ", group_.label());
  init();
}

int FastcommBackend::global_rank(int64_t group_rank, const char* api, const char* arg) const {
  TORCH_CHECK_VALUE(group_rank >= 0 && group_rank < (int64_t)group_.ranks.size(), "fastcomm backend: ",
                    api, ": rank ", engine_->rank(), ", group ", group_.label(), ": argument '", arg,
                    "' is group rank ", group_rank, ", outside the group of size ", group_.ranks.size());
  return group_.ranks[group_rank];
}

const at::Tensor& FastcommBackend::single(const std::vector<at::Tensor>& v, const char* api,
                                          const char* arg) const {
  // Like NCCL (and unlike Gloo's legacy multi-device allreduce/broadcast), one tensor per call:
  // multi-tensor lists were the removed *_multigpu API.
  TORCH_CHECK_VALUE(v.size() == 1, "fastcomm backend: ", api, ": rank ", engine_->rank(), ", group ",
                    group_.label(), ": argument '", arg, "' must hold exactly one tensor, got ",
                    v.size());
  return v[0];
}

std::vector<at::Tensor> FastcommBackend::root_list(const std::vector<std::vector<at::Tensor>>& v, const char* api,
                                                   const char* arg) const {
  TORCH_CHECK_VALUE(v.size() <= 1, "fastcomm backend: ", api, ": rank ", engine_->rank(), ", group ", group_.label(),
                    ": argument '", arg, "' must hold at most one list, got ", v.size());
  return v.empty() ? std::vector<at::Tensor>{} : v[0];
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::run(std::vector<OpRequest> reqs, bool async_op) {
  Engine::PreparedOps ops;
  ops.reserve(reqs.size());
  const bool p2p = !reqs.empty() && (reqs[0].kind == OpKind::kSend || reqs[0].kind == OpKind::kRecv);
  for (auto& r : reqs) ops.push_back(engine_->prepare(std::move(r), group_));
  if (!p2p) ++collectives_;  // as Gloo counts: calls that passed their checks, not messages
  // The error, if any, stays in the Work: torch's Python layer calls wait() next, which raises it.
  return engine_->run(ops, async_op, /*rethrow=*/false);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::run(OpRequest req, bool async_op) {
  std::vector<OpRequest> reqs;
  reqs.push_back(std::move(req));
  return run(std::move(reqs), async_op);
}

namespace {
OpRequest request(OpKind k, at::Tensor tensor, RedOp op = c10d::ReduceOp::SUM) {
  OpRequest r;
  r.kind = k;
  r.tensor = std::move(tensor);
  r.redop = op;
  return r;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> FastcommBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = single(tensors, "broadcast", "tensors");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "fastcomm backend: broadcast: rank ", engine_->rank(), ", group ",
                    group_.label(), ": rootTensor must be 0, got ", opts.rootTensor);
  OpRequest r = request(OpKind::kBroadcast, t);
  r.peer = global_rank(opts.rootRank, "broadcast", "rootRank");
  return run(std::move(r), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = single(tensors, "allreduce", "tensors");
  return run(request(OpKind::kAllReduce, t, opts.reduceOp.op_), opts.asyncOp);
}

// torch's dispatcher sends an all_reduce of sparse tensors here; the engine tells them apart.
c10::intrusive_ptr<c10d::Work> FastcommBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                 const c10d::AllreduceOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                    const c10d::AllreduceCoalescedOptions& opts) {
  std::vector<OpRequest> reqs;
  reqs.reserve(tensors.size());
  for (const auto& t : tensors) reqs.push_back(request(OpKind::kAllReduce, t, opts.reduceOp.op_));
  return run(std::move(reqs), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  const at::Tensor& in = single(inputs, "allgather", "inputTensors");
  TORCH_CHECK_VALUE(outputs.size() == 1, "fastcomm backend: allgather: rank ", engine_->rank(), ", group ",
                    group_.label(), ": argument 'outputTensors' must hold exactly one list, got ", outputs.size());
  OpRequest r = request(OpKind::kAllGather, in);
  r.list = outputs[0];
  return run(std::move(r), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                    std::vector<at::Tensor>& inputs,
                                                                    const c10d::AllgatherOptions& opts) {
  const size_t n = group_.ranks.size();
  TORCH_CHECK_VALUE(outputs.size() == n, "fastcomm backend: allgather_coalesced: rank ", engine_->rank(), ", group ",
                    group_.label(), ": argument 'output_tensor_lists' must hold one list per member (", n,
                    "), got ", outputs.size());
  for (size_t r = 0; r < n; ++r)
    TORCH_CHECK_VALUE(outputs[r].size() == inputs.size(), "fastcomm backend: allgather_coalesced: rank ",
                      engine_->rank(), ", group ", group_.label(), ": argument 'output_tensor_lists' [", r,
                      "] must hold one tensor per input (", inputs.size(), "), got ", outputs[r].size());
  // One all_gather per input, issued together as one Work.
  std::vector<OpRequest> reqs;
  reqs.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    OpRequest r = request(OpKind::kAllGather, inputs[i]);
    for (size_t m = 0; m < n; ++m) r.list.push_back(outputs[m][i]);
    reqs.push_back(std::move(r));
  }
  return run(std::move(reqs), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
  OpRequest r = request(OpKind::kAllGatherIntoTensor, input);
  r.output = output;
  return run(std::move(r), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                std::vector<at::Tensor>& inputs,
                                                                                const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "fastcomm backend: allgather_into_tensor_coalesced: rank ",
                    engine_->rank(), ", group ", group_.label(), ": ", outputs.size(), " outputs but ", inputs.size(),
                    " inputs");
  std::vector<OpRequest> reqs;
  reqs.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    reqs.push_back(request(OpKind::kAllGatherIntoTensor, inputs[i]));
    reqs.back().output = outputs[i];
  }
  return run(std::move(reqs), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& out = single(outputs, "reduce_scatter", "outputTensors");
  TORCH_CHECK_VALUE(inputs.size() == 1, "fastcomm backend: reduce_scatter: rank ", engine_->rank(), ", group ",
                    group_.label(), ": argument 'inputTensors' must hold exactly one list, got ", inputs.size());
  OpRequest r = request(OpKind::kReduceScatter, at::Tensor(), opts.reduceOp.op_);
  r.output = out;
  r.list = inputs[0];
  return run(std::move(r), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
  OpRequest r = request(OpKind::kReduceScatterTensor, input, opts.reduceOp.op_);
  r.output = output;
  return run(std::move(r), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "fastcomm backend: reduce_scatter_tensor_coalesced: rank ",
                    engine_->rank(), ", group ", group_.label(), ": ", outputs.size(), " outputs but ", inputs.size(),
                    " inputs");
  std::vector<OpRequest> reqs;
  reqs.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    reqs.push_back(request(OpKind::kReduceScatterTensor, inputs[i], opts.reduceOp.op_));
    reqs.back().output = outputs[i];
  }
  return run(std::move(reqs), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  const at::Tensor& t = single(tensors, "reduce", "tensors");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "fastcomm backend: reduce: rank ", engine_->rank(), ", group ",
                    group_.label(), ": rootTensor must be 0, got ", opts.rootTensor);
  OpRequest r = request(OpKind::kReduce, t, opts.reduceOp.op_);
  r.peer = global_rank(opts.rootRank, "reduce", "rootRank");
  return run(std::move(r), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::GatherOptions& opts) {
  OpRequest r = request(OpKind::kGather, single(inputs, "gather", "inputTensors"));
  r.list = root_list(outputs, "gather", "outputTensors");
  r.peer = global_rank(opts.rootRank, "gather", "rootRank");
  return run(std::move(r), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::scatter(std::vector<at::Tensor>& outputs,
                                                        std::vector<std::vector<at::Tensor>>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  OpRequest r = request(OpKind::kScatter, single(outputs, "scatter", "outputTensors"));
  r.list = root_list(inputs, "scatter", "inputTensors");
  r.peer = global_rank(opts.rootRank, "scatter", "rootRank");
  return run(std::move(r), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  OpRequest r = request(OpKind::kAllToAll, at::Tensor());
  r.list = outputs;
  r.inputs = inputs;
  return run(std::move(r), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& outputSplitSizes,
                                                              std::vector<int64_t>& inputSplitSizes,
                                                              const c10d::AllToAllOptions& opts) {
  OpRequest r = request(OpKind::kAllToAllSingle, input);
  r.output = output;
  r.output_splits = outputSplitSizes;
  r.input_splits = inputSplitSizes;
  return run(std::move(r), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::barrier(const c10d::BarrierOptions& opts) {
  // dist.barrier(timeout=...) is the barrier's own, longer or shorter than the group's, as in
  // Gloo (a member that comes later still passes it: this rank's arrival was sent).
  OpRequest r = request(OpKind::kBarrier, at::Tensor());
  if (opts.timeout != c10d::kUnsetTimeout && opts.timeout.count() > 0) r.timeout = opts.timeout;
  return run(std::move(r), opts.asyncOp);
}

// Point-to-point calls carry no asyncOp: torch waits on the Work itself for send/recv.
c10::intrusive_ptr<c10d::Work> FastcommBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  OpRequest r = request(OpKind::kSend, single(tensors, "send", "tensors"));
  r.peer = global_rank(dstRank, "send", "dstRank");
  r.tag = tag;
  return run(std::move(r), true);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  OpRequest r = request(OpKind::kRecv, single(tensors, "recv", "tensors"));
  r.peer = global_rank(srcRank, "recv", "srcRank");
  r.tag = tag;
  return run(std::move(r), true);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  OpRequest r = request(OpKind::kRecv, single(tensors, "recvAnysource", "tensors"));
  r.peer = kAnySource;
  r.tag = tag;
  return run(std::move(r), true);
}

void FastcommBackend::shutdown() {
  // A subgroup's backend owns nothing but its group record. The world group's backend made the
  // engine, so destroy_process_group() releases it (fails pending ops, stops its thread).
  if (owns_engine_) engine_->shutdown();
}

void FastcommBackend::abort() {
  if (owns_engine_) engine_->shutdown();
}

void register_backend_bindings(py::module_& m) {
  py::class_<FastcommBackend, c10d::Backend, c10::intrusive_ptr<FastcommBackend>>(
      m, "FastcommBackend",
      "fastcomm's torch.distributed backend over one engine group (made by fastcomm.backend)")
      .def(py::init([](std::shared_ptr<Engine> engine, const GroupHandle& group, bool owns_engine) {
             return c10::make_intrusive<FastcommBackend>(std::move(engine), group, owns_engine);
           }),
           py::arg("engine"), py::arg("group"), py::arg("owns_engine"))
      .def_property_readonly("group_ranks", [](const FastcommBackend& b) { return b.group().ranks; })
      .def_property_readonly("owns_engine", &FastcommBackend::owns_engine);
}

}  // namespace fastcomm
