// Each collective kind's checks (beyond check_request's) and how its request becomes one of the
// algorithms of collectives.h; collective_spec() is the table the engine looks kinds up in.

#include "algorithms/collectives.h"
#include "algorithms/request.h"
#include "common/errors.h"

namespace fastcomm {
namespace {

void check_nothing(const OpRequest&, const GroupView&) {}

void check_all_reduce(const OpRequest& r, const GroupView& g) {
  check_tensor(r.tensor, g, r.kind, "tensor");
  check_reduce_op(r.redop, r.tensor.scalar_type(), g, r.kind);
}

// What torch's Gloo backend takes: a COO tensor on the CPU, SUM.
void check_sparse_all_reduce(const OpRequest& r, const GroupView& g) {
  const at::Tensor& t = r.tensor;
  TORCH_CHECK_VALUE(t.layout() == c10::kSparse, "fastcomm.all_reduce: rank ", g.global_rank, ", group ", g.label(),
                    ": argument 'tensor' has layout ", t.layout(), ", expected a sparse COO tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), "fastcomm.all_reduce: rank ", g.global_rank, ", group ", g.label(),
                    ": argument 'tensor' is a sparse tensor on ", t.device(),
                    "; sparse all_reduce runs on CPU tensors only (move it with .cpu())");
  TORCH_CHECK_TYPE(collective_dtype(t.scalar_type()) && t.scalar_type() != c10::ScalarType::Bool,
                   "fastcomm.all_reduce: rank ", g.global_rank, ", group ", g.label(),
                   ": argument 'tensor' is a sparse tensor of unsupported dtype ", t.scalar_type());
  TORCH_CHECK_VALUE(r.redop == c10d::ReduceOp::SUM, "fastcomm.all_reduce: rank ", g.global_rank, ", group ",
                    g.label(), ": argument 'op' ", redop_name(r.redop),
                    " is not supported on sparse tensors (SUM is, as in torch's Gloo backend)");
}

std::unique_ptr<Op> lower_sparse_all_reduce(const OpRequest& r, const GroupView& g) {
  return make_sparse_all_reduce(r.tensor, g);
}

void check_broadcast(const OpRequest& r, const GroupView& g) {
  check_tensor(r.tensor, g, r.kind, "tensor");
  g.group_rank_of(r.peer, "broadcast", "src");
}

std::unique_ptr<Op> lower_broadcast(const OpRequest& r, const GroupView& g) {
  return make_broadcast(r.tensor, g.group_rank_of(r.peer, "broadcast", "src"), g.rank, g.size());
}

void check_all_gather(const OpRequest& r, const GroupView& g) {
  check_tensor(r.tensor, g, r.kind, "tensor");
  TORCH_CHECK_VALUE(r.list.size() == g.ranks.size(), "fastcomm.all_gather: rank ", g.global_rank, ", group ",
                    g.label(), ": argument 'tensor_list' has ", r.list.size(), " tensors, expected ",
                    g.ranks.size());
  // Every member's block is as large as its input: torch's Gloo refuses uneven blocks too
  // (all_to_all is the collective whose sizes may differ).
  for (size_t i = 0; i < r.list.size(); ++i)
    TORCH_CHECK_VALUE(!r.list[i].defined() || r.list[i].numel() == r.tensor.numel(), "fastcomm.all_gather: rank ",
                      g.global_rank, ", group ", g.label(), ": argument 'tensor_list[", i, "]' has ",
                      r.list[i].numel(), " elements, expected ", r.tensor.numel(),
                      " (those of 'tensor'): all_gather's blocks must all be the size of its input, as in torch's ",
                      "Gloo backend");
  for (size_t i = 0; i < r.list.size(); ++i)
    check_like(r.list[i], r.tensor, r.tensor.numel(), g, r.kind, {"tensor_list", i});
}

std::unique_ptr<Op> lower_all_gather(const OpRequest& r, const GroupView& g) {
  return make_all_gather(r.list, r.tensor, g.rank, g.size(), r.list);
}

// One block of `whole` per member (chunk() of an empty tensor yields a single chunk).
std::vector<at::Tensor> blocks(const at::Tensor& whole, int k) {
  auto flat = whole.reshape({-1});
  if (flat.numel() == 0) return std::vector<at::Tensor>(k, flat);
  return flat.chunk(k);
}

void check_all_gather_into_tensor(const OpRequest& r, const GroupView& g) {
  check_tensor(r.tensor, g, r.kind, "input_tensor");
  check_like(r.output, r.tensor, r.tensor.numel() * g.size(), g, r.kind, "output_tensor");
}

std::unique_ptr<Op> lower_all_gather_into_tensor(const OpRequest& r, const GroupView& g) {
  return make_all_gather(blocks(r.output, g.size()), r.tensor, g.rank, g.size(), {r.output});
}

void check_reduce_scatter(const OpRequest& r, const GroupView& g) {
  check_tensor(r.output, g, r.kind, "output");
  check_reduce_op(r.redop, r.output.scalar_type(), g, r.kind);
  TORCH_CHECK_VALUE(r.list.size() == g.ranks.size(), "fastcomm.reduce_scatter: rank ", g.global_rank,
                    ", group ", g.label(), ": argument 'input_list' has ", r.list.size(),
                    " tensors, expected ", g.ranks.size());
  // Block q is member q's output: the blocks may differ in size (as in torch's Gloo backend),
  // and each member's own is its output's size.
  for (size_t i = 0; i < r.list.size(); ++i)
    check_like(r.list[i], r.output, (int)i == g.rank ? r.output.numel() : -1, g, r.kind, {"input_list", i});
}

std::unique_ptr<Op> lower_reduce_scatter(const OpRequest& r, const GroupView& g) {
  return make_reduce_scatter(r.output, r.list, r.redop, g.rank, g.size(),
                             "fastcomm.reduce_scatter: rank " + std::to_string(g.global_rank) + ", group " + g.label());
}

void check_reduce_scatter_tensor(const OpRequest& r, const GroupView& g) {
  check_tensor(r.output, g, r.kind, "output");
  check_reduce_op(r.redop, r.output.scalar_type(), g, r.kind);
  check_like(r.tensor, r.output, r.output.numel() * g.size(), g, r.kind, "input");
}

std::unique_ptr<Op> lower_reduce_scatter_tensor(const OpRequest& r, const GroupView& g) {
  return make_reduce_scatter(r.output, blocks(r.tensor, g.size()), r.redop, g.rank, g.size(),
                             "fastcomm.reduce_scatter_tensor: rank " + std::to_string(g.global_rank) + ", group " +
                                 g.label());
}

void check_p2p(const OpRequest& r, const GroupView& g) {
  const char* api = op_kind_name(r.kind);
  const char* arg = r.kind == OpKind::kSend ? "dst" : "src";
  check_tensor(r.tensor, g, r.kind, "tensor");
  if (r.kind == OpKind::kRecv && r.peer == kAnySource) {
    TORCH_CHECK_VALUE(g.size() >= 2, "fastcomm.recv: rank ", g.global_rank, ", group ", g.label(),
                      ": argument 'src' is None (any source), but the group has no other member");
    return;
  }
  g.group_rank_of(r.peer, api, arg);
  TORCH_CHECK_VALUE(r.peer != g.global_rank, "fastcomm.", api, ": rank ", g.global_rank, ", group ", g.label(),
                    ": argument '", arg, "' is this rank itself");
}

std::unique_ptr<Op> lower_p2p(const OpRequest& r, const GroupView& channel) {
  const int peer_rank = channel.ranks[0] == r.peer ? 0 : 1;
  return make_p2p(r.tensor, r.kind == OpKind::kSend, peer_rank, channel.rank);
}

void check_reduce(const OpRequest& r, const GroupView& g) {
  check_tensor(r.tensor, g, r.kind, "tensor");
  check_reduce_op(r.redop, r.tensor.scalar_type(), g, r.kind);
  g.group_rank_of(r.peer, "reduce", "dst");
}

std::unique_ptr<Op> lower_reduce(const OpRequest& r, const GroupView& g) {
  return make_reduce(r.tensor, g.group_rank_of(r.peer, "reduce", "dst"), r.redop, g.rank, g.size());
}

// gather and scatter: `list` (one tensor like `tensor` per member) on the root only.
void check_rooted_copy(const OpRequest& r, const GroupView& g) {
  const bool gather = r.kind == OpKind::kGather;
  const char* api = gather ? "gather" : "scatter";
  const char* root_arg = gather ? "dst" : "src";
  const char* list_arg = gather ? "gather_list" : "scatter_list";
  check_tensor(r.tensor, g, r.kind, "tensor");
  const int root = g.group_rank_of(r.peer, api, root_arg);
  if (g.rank != root) {
    TORCH_CHECK_VALUE(r.list.empty(), "fastcomm.", api, ": rank ", g.global_rank, ", group ", g.label(),
                      ": argument '", list_arg, "' must be None or empty on a rank other than '", root_arg,
                      "' (rank ", r.peer, "), got ", r.list.size(), " tensors");
    return;
  }
  TORCH_CHECK_VALUE(r.list.size() == g.ranks.size(), "fastcomm.", api, ": rank ", g.global_rank, ", group ",
                    g.label(), ": argument '", list_arg, "' has ", r.list.size(), " tensors, expected ",
                    g.ranks.size(), " (one per member) on '", root_arg, "'");
  for (size_t i = 0; i < r.list.size(); ++i)
    check_like(r.list[i], r.tensor, r.tensor.numel(), g, r.kind, {list_arg, i});
}

std::unique_ptr<Op> lower_rooted_copy(const OpRequest& r, const GroupView& g) {
  const int root = g.group_rank_of(r.peer, op_kind_name(r.kind), r.kind == OpKind::kGather ? "dst" : "src");
  return make_rooted_copy(r.kind, r.tensor, r.list, root, g.rank, g.size());
}

Span span_of(const at::Tensor& t) { return Span::of(t.data_ptr(), nbytes(t)); }

void check_all_to_all(const OpRequest& r, const GroupView& g) {
  const size_t k = g.ranks.size();
  TORCH_CHECK_VALUE(r.inputs.size() == k, "fastcomm.all_to_all: rank ", g.global_rank, ", group ", g.label(),
                    ": argument 'input_tensor_list' has ", r.inputs.size(), " tensors, expected ", k);
  TORCH_CHECK_VALUE(r.list.size() == k, "fastcomm.all_to_all: rank ", g.global_rank, ", group ", g.label(),
                    ": argument 'output_tensor_list' has ", r.list.size(), " tensors, expected ", k);
  check_tensor(r.inputs[0], g, r.kind, "input_tensor_list[0]");
  for (size_t i = 1; i < k; ++i)
    check_like(r.inputs[i], r.inputs[0], -1, g, r.kind, {"input_tensor_list", i});
  for (size_t i = 0; i < k; ++i)
    check_like(r.list[i], r.inputs[0], -1, g, r.kind, {"output_tensor_list", i});
  const at::Tensor& in = r.inputs[g.rank];
  const at::Tensor& out = r.list[g.rank];
  TORCH_CHECK_VALUE(out.numel() == in.numel(), "fastcomm.all_to_all: rank ", g.global_rank, ", group ", g.label(),
                    ": argument 'output_tensor_list[", g.rank, "]' has ", out.numel(),
                    " elements, but this rank's own input_tensor_list[", g.rank, "] has ", in.numel());
}

std::unique_ptr<Op> lower_all_to_all(const OpRequest& r, const GroupView& g) {
  std::vector<Span> send, recv;
  for (const auto& t : r.inputs) send.push_back(span_of(t));
  for (const auto& t : r.list) recv.push_back(span_of(t));
  const at::Tensor& ref = r.inputs[0];
  return make_all_to_all(std::move(send), std::move(recv), r.list, r.inputs, ref.scalar_type(), ref.element_size(),
                         g, r.kind);
}

// Elements of each member's block of `t`, split along dim 0 by `splits` (empty: equally);
// throws naming `arg` and `splits_arg` if they do not fit.
std::vector<int64_t> split_numels(const at::Tensor& t, const std::vector<int64_t>& splits, const GroupView& g,
                                  const char* arg, const char* splits_arg) {
  const int64_t k = g.size();
  TORCH_CHECK_VALUE(t.dim() >= 1, "fastcomm.all_to_all_single: rank ", g.global_rank, ", group ", g.label(),
                    ": argument '", arg, "' must have at least one dimension (it is split along dim 0)");
  const int64_t rows = t.size(0);
  const int64_t row = rows ? t.numel() / rows : 0;
  std::vector<int64_t> out;
  if (splits.empty()) {
    TORCH_CHECK_VALUE(rows % k == 0, "fastcomm.all_to_all_single: rank ", g.global_rank, ", group ", g.label(),
                      ": argument '", arg, "' has ", rows, " rows (dim 0), which do not split equally over ", k,
                      " members; pass '", splits_arg, "'");
    return std::vector<int64_t>(k, rows / k * row);
  }
  TORCH_CHECK_VALUE((int64_t)splits.size() == k, "fastcomm.all_to_all_single: rank ", g.global_rank, ", group ",
                    g.label(), ": argument '", splits_arg, "' has ", splits.size(), " entries, expected ", k);
  int64_t sum = 0;
  for (size_t i = 0; i < splits.size(); ++i) {
    TORCH_CHECK_VALUE(splits[i] >= 0, "fastcomm.all_to_all_single: rank ", g.global_rank, ", group ", g.label(),
                      ": argument '", splits_arg, "' has a negative entry ", splits[i], " at ", i);
    sum += splits[i];
    out.push_back(splits[i] * row);
  }
  TORCH_CHECK_VALUE(sum == rows, "fastcomm.all_to_all_single: rank ", g.global_rank, ", group ", g.label(),
                    ": argument '", splits_arg, "' sums to ", sum, " but '", arg, "' has ", rows,
                    " rows (dim 0)");
  return out;
}

void check_all_to_all_single(const OpRequest& r, const GroupView& g) {
  check_tensor(r.tensor, g, r.kind, "input");
  check_like(r.output, r.tensor, -1, g, r.kind, "output");
  const auto in = split_numels(r.tensor, r.input_splits, g, "input", "input_split_sizes");
  const auto out = split_numels(r.output, r.output_splits, g, "output", "output_split_sizes");
  TORCH_CHECK_VALUE(in[g.rank] == out[g.rank], "fastcomm.all_to_all_single: rank ", g.global_rank, ", group ",
                    g.label(), ": this rank's own block has ", out[g.rank], " elements in 'output' but ",
                    in[g.rank], " in 'input'");
}

std::unique_ptr<Op> lower_all_to_all_single(const OpRequest& r, const GroupView& g) {
  const auto in = split_numels(r.tensor, r.input_splits, g, "input", "input_split_sizes");
  const auto out = split_numels(r.output, r.output_splits, g, "output", "output_split_sizes");
  const size_t es = r.tensor.element_size();
  std::vector<Span> send, recv;
  size_t a = 0, b = 0;
  for (int q = 0; q < g.size(); ++q) {
    send.push_back(Span::of(bytes(r.tensor) + a, in[q] * es));
    recv.push_back(Span::of(bytes(r.output) + b, out[q] * es));
    a += in[q] * es;
    b += out[q] * es;
  }
  return make_all_to_all(std::move(send), std::move(recv), {r.output}, {r.tensor}, r.tensor.scalar_type(), es, g,
                         r.kind);
}

}  // namespace

const CollectiveSpec& collective_spec(OpKind k) {
  static const CollectiveSpec all_reduce{check_all_reduce, make_all_reduce, false};
  static const CollectiveSpec broadcast{check_broadcast, lower_broadcast, false};
  static const CollectiveSpec all_gather{check_all_gather, lower_all_gather, false};
  static const CollectiveSpec all_gather_into_tensor{check_all_gather_into_tensor, lower_all_gather_into_tensor,
                                                   false};
  static const CollectiveSpec reduce_scatter{check_reduce_scatter, lower_reduce_scatter, false};
  static const CollectiveSpec reduce_scatter_tensor{check_reduce_scatter_tensor, lower_reduce_scatter_tensor,
                                                   false};
  static const CollectiveSpec barrier{check_nothing, make_barrier, false};
  static const CollectiveSpec p2p{check_p2p, lower_p2p, true};
  static const CollectiveSpec reduce{check_reduce, lower_reduce, false};
  static const CollectiveSpec rooted_copy{check_rooted_copy, lower_rooted_copy, false};
  static const CollectiveSpec all_to_all{check_all_to_all, lower_all_to_all, false};
  static const CollectiveSpec all_to_all_single{check_all_to_all_single, lower_all_to_all_single, false};
  static const CollectiveSpec sparse_all_reduce{check_sparse_all_reduce, lower_sparse_all_reduce, false};
  switch (k) {
    case OpKind::kAllReduce: return all_reduce;
    case OpKind::kBroadcast: return broadcast;
    case OpKind::kAllGather: return all_gather;
    case OpKind::kAllGatherIntoTensor: return all_gather_into_tensor;
    case OpKind::kReduceScatter: return reduce_scatter;
    case OpKind::kReduceScatterTensor: return reduce_scatter_tensor;
    case OpKind::kBarrier: return barrier;
    case OpKind::kSend:
    case OpKind::kRecv: return p2p;
    case OpKind::kReduce: return reduce;
    case OpKind::kGather:
    case OpKind::kScatter: return rooted_copy;
    case OpKind::kAllToAll: return all_to_all;
    case OpKind::kAllToAllSingle: return all_to_all_single;
    case OpKind::kSparseAllReduce: return sparse_all_reduce;
    case OpKind::kNone:
    case OpKind::kCount: break;
  }
  TORCH_CHECK_VALUE(false, "fastcomm: unknown op kind ", (int)k);
}

}  // namespace fastcomm
