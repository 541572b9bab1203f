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

c10::intrusive_ptr<c10d::Work> FastcommBackend::run(std::vector<Engine::Prepared> ops, bool async_op) {
  c10::intrusive_ptr<Work> w = engine_->post(std::move(ops), async_op);
  // Blocking call: drive the op to completion on this thread (the GIL is not held here). The
  // error, if any, stays in the Work: torch's Python layer calls wait() next, which raises it.
  if (!async_op) engine_->wait(*w, std::chrono::milliseconds(0));
  return w;
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::run(Engine::Prepared op, bool async_op) {
  std::vector<Engine::Prepared> ops;
  ops.push_back(std::move(op));
  return run(std::move(ops), async_op);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = single(tensors, "broadcast", "tensors");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "fastcomm backend: broadcast: rank ", engine_->rank(),
                    ", group ", group_.label(), ": rootTensor must be 0, got ", opts.rootTensor);
  const int src = global_rank(opts.rootRank, "broadcast", "rootRank");
  return run(engine_->prepare_broadcast(group_, t, src), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = single(tensors, "allreduce", "tensors");
  return run(engine_->prepare_all_reduce(group_, t, opts.reduceOp.op_), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  std::vector<Engine::Prepared> ops;
  ops.reserve(tensors.size());
  for (const auto& t : tensors) ops.push_back(engine_->prepare_all_reduce(group_, t, opts.reduceOp.op_));
  return run(std::move(ops), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  const at::Tensor& in = single(inputs, "allgather", "inputTensors");
  TORCH_CHECK_VALUE(outputs.size() == 1, "fastcomm backend: allgather: rank ", engine_->rank(),
                    ", group ", group_.label(), ": argument 'outputTensors' must hold exactly one list, got ",
                    outputs.size());
  return run(engine_->prepare_all_gather(group_, outputs[0], in), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
  return run(engine_->prepare_all_gather_into_tensor(group_, output, input), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "fastcomm backend: allgather_into_tensor_coalesced: rank ",
                    engine_->rank(), ", group ", group_.label(), ": ", outputs.size(), " outputs but ",
                    inputs.size(), " inputs");
  std::vector<Engine::Prepared> ops;
  ops.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    ops.push_back(engine_->prepare_all_gather_into_tensor(group_, outputs[i], inputs[i]));
  return run(std::move(ops), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& out = single(outputs, "reduce_scatter", "outputTensors");
  TORCH_CHECK_VALUE(inputs.size() == 1, "fastcomm backend: reduce_scatter: rank ", engine_->rank(),
                    ", group ", group_.label(), ": argument 'inputTensors' must hold exactly one list, got ",
                    inputs.size());
  return run(engine_->prepare_reduce_scatter(group_, out, inputs[0], opts.reduceOp.op_), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
  return run(engine_->prepare_reduce_scatter_tensor(group_, output, input, opts.reduceOp.op_), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "fastcomm backend: reduce_scatter_tensor_coalesced: rank ",
                    engine_->rank(), ", group ", group_.label(), ": ", outputs.size(), " outputs but ",
                    inputs.size(), " inputs");
  std::vector<Engine::Prepared> ops;
  ops.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    ops.push_back(engine_->prepare_reduce_scatter_tensor(group_, outputs[i], inputs[i], opts.reduceOp.op_));
  return run(std::move(ops), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::barrier(const c10d::BarrierOptions& opts) {
  return run(engine_->prepare_barrier(group_), opts.asyncOp);
}

// Point-to-point calls carry no asyncOp: torch waits on the Work itself for send/recv.
c10::intrusive_ptr<c10d::Work> FastcommBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  const at::Tensor& t = single(tensors, "send", "tensors");
  const int dst = global_rank(dstRank, "send", "dstRank");
  return run(engine_->prepare_p2p(group_, t, dst, tag, true), true);
}

c10::intrusive_ptr<c10d::Work> FastcommBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  const at::Tensor& t = single(tensors, "recv", "tensors");
  const int src = global_rank(srcRank, "recv", "srcRank");
  return run(engine_->prepare_p2p(group_, t, src, tag, false), true);
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
