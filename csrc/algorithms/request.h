#pragma once
// A collective as the caller asked for it, on any device: what every entry point (the native
// API, the torch backend) builds, what one set of argument checks validates, and what each
// device lowers into its own form (host state machines here, NCCL calls in csrc/cuda).
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <chrono>
#include <vector>

#include "algorithms/op.h"

namespace fastcomm {

using RedOp = c10d::ReduceOp::RedOpType;

// recv's peer when it takes the first matching message from any other member of its group.
constexpr int kAnySource = -1;

struct OpRequest {
  OpKind kind = OpKind::kNone;
  at::Tensor tensor;             // the op's tensor (in place), or its input
  at::Tensor output;             // a separate output: all_gather_into_tensor, reduce_scatter*,
                                 // all_to_all_single
  std::vector<at::Tensor> list;  // all_gather, gather, all_to_all: the outputs;
                                 // reduce_scatter, scatter: the inputs
  std::vector<at::Tensor> inputs;  // all_to_all: the inputs
  // all_to_all_single: rows (dim 0) of `output` from and of `tensor` to each member; empty:
  // equal parts.
  std::vector<int64_t> output_splits, input_splits;
  RedOp redop = c10d::ReduceOp::SUM;
  int peer = -1;                 // a global rank: broadcast's and scatter's src, reduce's and
                                 // gather's dst, send's dst, recv's src (or kAnySource)
  int tag = 0;                   // send/recv
  // > 0: this op's own timeout instead of its group's (dist.barrier(timeout=...)).
  std::chrono::milliseconds timeout{0};
};

// The group an op runs on, from this member's side.
struct GroupView {
  const std::vector<int>& ranks;  // sorted global ranks; group rank i is ranks[i]
  int rank;                       // this member's group rank
  int global_rank;
  std::shared_ptr<const HostLayout> hosts;  // set: all_reduce and barrier run hierarchically
  size_t rsag_threshold;          // bytes from which groups of 3+ reduce-scatter + all-gather
  // Bytes from which a flat all_reduce first tries reading the members' shared buffers in place
  // (algorithms/direct.h).
  size_t direct_min = SIZE_MAX;
  // Bytes up to which an all_reduce in a pair on one host travels as one message each way
  // (PairAllReduce in algorithms/collectives.cpp); 0: never.
  size_t pair_message_max = 0;
  int size() const { return (int)ranks.size(); }
  std::string label() const;
  // Group rank of global rank `global`, an argument named `arg`; throws if not a member.
  int group_rank_of(int global, const char* api, const char* arg) const;
};

// How one kind of op is checked and run on the host (algorithms/collectives.cpp).
struct CollectiveSpec {
  // Checks beyond those every op gets (membership, tensor basics); throws naming rank, group
  // and argument.
  void (*check)(const OpRequest& r, const GroupView& g);
  // The host algorithm. For send/recv, `g` is the two-member channel of the pair (a recv from
  // any source is made once its sender is known).
  std::unique_ptr<Op> (*make)(const OpRequest& r, const GroupView& g);
  bool p2p;  // runs on a channel per (group, src, dst, tag) instead of the group itself
};
const CollectiveSpec& collective_spec(OpKind k);

// Every argument check of a request, whatever its device (the kind's check, which checks each
// tensor with check_tensor or check_like). Nothing is sent before these pass.
void check_request(const OpRequest& r, const GroupView& g);
// The device every tensor of `r` is on (CPU for an op without tensors).
c10::Device request_device(const OpRequest& r);

// What the kinds' checks are made of; messages name api, rank, group and argument.
// check_tensor: defined, dense, on CPU or CUDA, contiguous, no lazy conjugate or negative bit,
// a supported dtype (those the kernels fold, and complex ones). check_like: that, and the
// dtype and device of `ref` with `numel` elements (any number if negative).
// An argument's name in messages, `name` or `name[index]`: spelled out only when a check fails
// (a string per list item and call would cost an allocation each on the hot path).
struct ArgName {
  const char* name;
  int64_t index = -1;
  ArgName(const char* n) : name(n) {}  // NOLINT: implicit, a plain argument's name
  ArgName(const char* n, size_t i) : name(n), index((int64_t)i) {}
};
std::ostream& operator<<(std::ostream& os, const ArgName& a);
void check_tensor(const at::Tensor& t, const GroupView& g, OpKind k, ArgName arg);
// The dtypes a collective takes: those the kernels fold, and complex ones (as real views).
bool collective_dtype(c10::ScalarType dt);
void check_like(const at::Tensor& t, const at::Tensor& ref, int64_t numel, const GroupView& g, OpKind k,
                ArgName arg);
// Whether `op` folds dtype `dt`: complex dtypes only with SUM and AVG, which fold the real and
// imaginary parts apart (torch's supports_complex); AVG on floating and complex dtypes, bitwise
// ops on integers and bool.
void check_reduce_op(RedOp op, c10::ScalarType dt, const GroupView& g, OpKind k);

// Complex tensors run as their real view (two reals per element), as torch's Python layer
// hands them to a backend: the algorithms and kernels below see only real dtypes. Replaces
// every complex tensor of a checked request by its view; returns (view, tensor as given)
// pairs, so that what the op reports can be given back as the caller passed it.
using RealViews = std::vector<std::pair<at::Tensor, at::Tensor>>;
RealViews view_complex_as_real(OpRequest& r);
// Each of `ts` that is one of the views, replaced by the caller's tensor.
void restore_complex(std::vector<at::Tensor>& ts, const RealViews& views);

}  // namespace fastcomm
