#include "device/ops.h"

#include <algorithm>

namespace fastcomm {
namespace device {

namespace {

using R = c10d::ReduceOp;

// The dtypes and ops the device fold takes (the CUDA kernel's set; the fake keeps it).
bool folds(c10::ScalarType t) {
  switch (t) {
    case c10::kHalf: case c10::kBFloat16: case c10::kFloat: case c10::kDouble: case c10::kChar:
    case c10::kByte: case c10::kShort: case c10::kInt: case c10::kLong:
      return true;
    default:
      return false;
  }
}

// The dtypes NCCL reduces (ncclDataType_t): no int16, so those ops stay on the fold.
bool nccl_reduces(c10::ScalarType t) {
  switch (t) {
    case c10::kHalf: case c10::kBFloat16: case c10::kFloat: case c10::kDouble: case c10::kChar:
    case c10::kByte: case c10::kInt: case c10::kLong:
      return true;
    default:
      return false;
  }
}

// Bytes of each member's block of `t`, split along dim 0 by `splits` (empty: equally); the
// request's checks made sure they fit.
std::vector<size_t> split_bytes(const at::Tensor& t, const std::vector<int64_t>& splits, int n) {
  const int64_t rows = t.dim() ? t.size(0) : 0;
  const size_t row = rows ? t.nbytes() / (size_t)rows : 0;
  std::vector<size_t> out((size_t)n, splits.empty() ? (size_t)(rows / n) * row : 0);
  for (size_t i = 0; i < splits.size() && i < out.size(); ++i) out[i] = (size_t)splits[i] * row;
  return out;
}

}  // namespace

}  // namespace device

bool device_runs(OpKind k) {
  switch (k) {
    case OpKind::kAllReduce: case OpKind::kBroadcast: case OpKind::kAllGather: case OpKind::kAllGatherIntoTensor:
    case OpKind::kReduceScatter: case OpKind::kReduceScatterTensor: case OpKind::kSend: case OpKind::kRecv:
    case OpKind::kReduce: case OpKind::kGather: case OpKind::kScatter: case OpKind::kAllToAll:
    case OpKind::kAllToAllSingle:
      return true;
    default:
      return false;
  }
}

namespace device {

std::string sig_str(const Sig& s) {
  std::string r = op_kind_name((OpKind)s.kind);
  r += "(" + std::string(c10::toString((c10::ScalarType)s.dtype)) + ", ";
  if (s.kind == (uint8_t)OpKind::kAllToAll)
    r += "sending " + std::to_string(s.bytes) + " bytes to and receiving " + std::to_string(s.back) +
         " bytes from the other";
  else
    r += std::to_string(s.bytes) + " bytes";
  if (s.kind == (uint8_t)OpKind::kAllReduce || s.kind == (uint8_t)OpKind::kReduceScatter ||
      s.kind == (uint8_t)OpKind::kReduceScatterTensor || s.kind == (uint8_t)OpKind::kReduce)
    r += std::string(", op ") + redop_name(s.redop);
  if (s.root >= 0) r += ", root " + std::to_string(s.root);
  if (s.flags & kOnGroupComm) r += ", on the group's communicator";
  if (s.flags & kGroupBroken)
    r += (s.flags & kLinkAG) ? ", whose reduce-scatter had failed" : ", whose group communicator had failed";
  if (s.flags & kLinkRS) r += ", its reduce-scatter over the pair links";
  if (s.flags & kLinkAG) r += ", its all-gather over the pair links";
  return r + ")";
}

bool compatible(const Sig& a, const Sig& b) {
  const bool p2p = (a.kind == (uint8_t)OpKind::kSend && b.kind == (uint8_t)OpKind::kRecv) ||
                   (a.kind == (uint8_t)OpKind::kRecv && b.kind == (uint8_t)OpKind::kSend);
  if (p2p) return a.dtype == b.dtype && a.bytes == b.bytes;
  // all_to_all: what one side sends is what the other receives (a zero-byte pair still agrees).
  if (a.kind == (uint8_t)OpKind::kAllToAll)
    return a.kind == b.kind && a.dtype == b.dtype && a.flags == b.flags && a.bytes == b.back && a.back == b.bytes;
  return a == b && !(a.flags & kGroupBroken);
}

std::unique_ptr<DevOp> lower(DeviceOp& d, const std::shared_ptr<Batch>& batch, const Lowering& how,
                             std::unique_ptr<DevOp>* second) {
  Runtime& rt = how.rt;
  const int rank_ = how.rank;
  OpRequest& r = d.req;
  const int n = (int)d.ranks.size(), me = d.rank;
  const char* api = op_kind_name(r.kind);
  const c10::Device dev = request_device(r);
  TORCH_CHECK_VALUE(dev.is_cpu() || dev.index() == rt.device(), "fastcomm.", api, ": rank ", rank_, ", group ",
                    d.label, ": the op's tensors are on ", dev, " but this process's device engine drives ",
                    dev.type(), ":", rt.device(), " (one device per process)");
  TORCH_CHECK_VALUE(device_runs(r.kind), "fastcomm.", api, ": rank ", rank_, ", group ", d.label,
                    ": not supported for ", dev.type(), " tensors");
  auto op = std::make_unique<DevOp>();
  op->kind = r.kind;
  op->label = d.label;
  op->batch = batch;
  op->timeout = d.timeout;
  if (d.recv_port) {
    op->recv_port = true;
    op->port = {d.port_group, d.port_tag};
    op->any_source = r.peer == kAnySource;
    op->from = d.from;
  }
  const bool reduces = r.kind == OpKind::kAllReduce || r.kind == OpKind::kReduceScatter ||
                       r.kind == OpKind::kReduceScatterTensor || r.kind == OpKind::kReduce;
  const at::Tensor& typed = r.kind == OpKind::kAllToAll ? r.inputs.at(0) : r.output.defined() ? r.output : r.tensor;
  if (reduces) {
    TORCH_CHECK_TYPE(folds(typed.scalar_type()), "fastcomm.", api, ": rank ", rank_, ", group ", d.label, ": dtype ",
                     typed.scalar_type(), " is not supported for ", dev.type(), " tensors");
    TORCH_CHECK_VALUE(r.redop == R::SUM || r.redop == R::AVG || r.redop == R::PRODUCT || r.redop == R::MIN ||
                          r.redop == R::MAX,
                      "fastcomm.", api, ": rank ", rank_, ", group ", d.label, ": argument 'op' ",
                      redop_name(r.redop), " is not supported for ", dev.type(), " tensors");
  }
  Sig sig;
  // all_to_all_single meets all_to_all, as on the host path (one algorithm, the pairs' sizes
  // agreed).
  sig.kind = (uint8_t)(r.kind == OpKind::kAllToAllSingle ? OpKind::kAllToAll : r.kind);
  sig.dtype = (uint8_t)typed.scalar_type();
  sig.redop = reduces ? (uint8_t)r.redop : 0;
  auto add_part = [&](int peer) -> Part& {
    op->parts.push_back(std::make_unique<Part>());
    Part& p = *op->parts.back();
    p.op = op.get();
    p.peer = peer;
    p.sig = sig;
    return p;
  };
  auto slot = [&](int j) { return (size_t)(j < me ? j : j - 1); };
  auto group_rank = [&](int global) { return (int)(std::find(d.ranks.begin(), d.ranks.end(), global) - d.ranks.begin()); };
  // A zero-size op moves nothing but is still agreed with every peer it would exchange with,
  // so a member that issued a non-empty op gets a mismatch, not a timeout.
  auto agree_with_all = [&] {
    for (int j = 0; j < n; ++j)
      if (j != me) add_part(d.ranks[j]);
  };
  // Large ops of groups of 3+: one collective on the group's communicator (GroupComm).
  const bool nccl_op = r.redop == R::SUM || r.redop == R::AVG || r.redop == R::PRODUCT;
  const bool collective = r.kind == OpKind::kBroadcast || r.kind == OpKind::kAllGatherIntoTensor ||
                          ((r.kind == OpKind::kAllReduce || r.kind == OpKind::kReduceScatterTensor) && nccl_op &&
                           nccl_reduces(typed.scalar_type()));
  const size_t per_member =
      !collective ? 0 : r.kind == OpKind::kReduceScatterTensor ? r.output.nbytes() : r.tensor.nbytes();
  if (how.group_comms && !how.links && n >= 3 && per_member > 0 && per_member >= how.group_comm_bytes) {
    Collective& c = op->coll;
    c.kind = r.kind;
    c.dtype = typed.scalar_type();
    c.op = r.redop;
    c.in = r.tensor.data_ptr();
    c.out = r.output.defined() ? r.output.data_ptr() : r.tensor.data_ptr();
    c.count = r.kind == OpKind::kReduceScatterTensor ? r.output.numel() : r.tensor.numel();
    if (r.kind == OpKind::kBroadcast || r.kind == OpKind::kAllGatherIntoTensor) c.count = (int64_t)per_member;
    c.root = (int)(std::find(d.ranks.begin(), d.ranks.end(), r.peer) - d.ranks.begin());
    op->keep = {r.tensor};
    if (r.output.defined()) op->keep.push_back(r.output);
    sig.bytes = per_member;
    sig.root = r.kind == OpKind::kBroadcast ? c.root : -1;
    sig.flags = kOnGroupComm;
    op->group_op = true;
    op->ranks = d.ranks;
    op->me = me;
    op->leads = me == 0;
    for (int j = 0; j < n; ++j) {
      if (j == me || (me != 0 && j != 0)) continue;
      add_part(d.ranks[j]).agree_only = true;
    }
    for (auto& p : op->parts) p->sig = sig;
    op->parts_left = op->parts_unlaunched = (int)op->parts.size();
    return op;
  }
  if (second != nullptr && how.links && n >= 3 && r.kind == OpKind::kAllReduce && r.tensor.nbytes() > 0 &&
      r.tensor.nbytes() >= how.group_comm_bytes) {
    // Reduce-scatter + all-gather over the pair links, as the host path runs large all_reduces
    // of 3+ (algorithms/collectives.cpp): member j folds chunk j from every member's (n - 1
    // received into scratch, in group-rank order), then sends it to every other member. Each
    // member moves 2 (n - 1) / n of the tensor each way instead of (n - 1) times it. The
    // all-gather is the group's next op: ready once the fold is enqueued, its transfers wait
    // for the fold's end as any op waits for its group's previous one.
    const size_t es = r.tensor.element_size(), numel = (size_t)r.tensor.numel();
    auto* base = (uint8_t*)r.tensor.data_ptr();
    auto off = [&](int j) { return numel * (size_t)j / (size_t)n; };
    auto len = [&](int j) { return off(j + 1) - off(j); };  // elements of chunk j (the host's split)
    sig.bytes = r.tensor.nbytes();
    sig.flags = kLinkRS;
    op->keep = {r.tensor};
    const size_t mine = len(me) * es;
    if (mine > 0) op->scratch = rt.scratch((int64_t)((n - 1) * len(me)), r.tensor, how.join);
    auto* s = mine > 0 ? (uint8_t*)op->scratch.data_ptr() : nullptr;
    for (int j = 0; j < n; ++j) {
      if (j == me) continue;
      Part& p = add_part(d.ranks[j]);
      if (len(j) > 0) p.sends.emplace_back(base + off(j) * es, len(j) * es);
      if (mine > 0) p.recvs.emplace_back(s + slot(j) * mine, mine);
    }
    if (mine > 0)
      op->folds.push_back(FoldJob{base + off(me) * es, base + off(me) * es, s, (int64_t)len(me), n, me,
                                  r.tensor.scalar_type(), r.redop});
    op->parts_left = op->parts_unlaunched = (int)op->parts.size();
    auto ag = std::make_unique<DevOp>();
    ag->kind = r.kind;
    ag->label = d.label;
    ag->batch = batch;
    ag->timeout = d.timeout;
    ag->keep = {r.tensor};
    ag->scattered = op.get();
    Sig agsig = sig;
    agsig.flags = kLinkAG;
    for (int j = 0; j < n; ++j) {
      if (j == me) continue;
      ag->parts.push_back(std::make_unique<Part>());
      Part& p = *ag->parts.back();
      p.op = ag.get();
      p.peer = d.ranks[j];
      p.sig = agsig;
      if (mine > 0) p.sends.emplace_back(base + off(me) * es, mine);
      if (len(j) > 0) p.recvs.emplace_back(base + off(j) * es, len(j) * es);
    }
    ag->parts_left = ag->parts_unlaunched = (int)ag->parts.size();
    *second = std::move(ag);
    return op;
  }
  switch (r.kind) {
    case OpKind::kAllReduce: {
      op->keep = {r.tensor};
      const size_t bytes = r.tensor.nbytes();
      sig.bytes = bytes;
      if (n == 1) break;
      if (bytes == 0) {
        agree_with_all();
        break;
      }
      op->scratch = rt.scratch((int64_t)(n - 1) * r.tensor.numel(), r.tensor, how.join);
      auto* s = (uint8_t*)op->scratch.data_ptr();
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        Part& p = add_part(d.ranks[j]);
        p.sends.emplace_back(r.tensor.data_ptr(), bytes);
        p.recvs.emplace_back(s + slot(j) * bytes, bytes);
      }
      op->folds.push_back(FoldJob{r.tensor.data_ptr(), r.tensor.data_ptr(), s, r.tensor.numel(), n, me,
                                  r.tensor.scalar_type(), r.redop});
      if (n == 2) {
        op->parts[0]->fold_in_ring = true;
        op->parts[0]->ring_fold = op->folds[0];
      }
      break;
    }
    case OpKind::kBroadcast: {
      op->keep = {r.tensor};
      const int root = (int)(std::find(d.ranks.begin(), d.ranks.end(), r.peer) - d.ranks.begin());
      const size_t bytes = r.tensor.nbytes();
      sig.bytes = bytes;
      sig.root = root;
      if (n == 1) break;
      if (me == root) {
        for (int j = 0; j < n; ++j)
          if (j != me) {
            Part& p = add_part(d.ranks[j]);
            if (bytes) p.sends.emplace_back(r.tensor.data_ptr(), bytes);
          }
      } else {
        Part& p = add_part(d.ranks[root]);
        if (bytes) p.recvs.emplace_back(r.tensor.data_ptr(), bytes);
      }
      break;
    }
    case OpKind::kAllGather:
    case OpKind::kAllGatherIntoTensor: {
      const bool flat = r.kind == OpKind::kAllGatherIntoTensor;
      op->keep = flat ? std::vector<at::Tensor>{r.tensor, r.output} : r.list;
      if (!flat) op->keep.push_back(r.tensor);
      const size_t bytes = r.tensor.nbytes();
      sig.bytes = bytes;
      auto block = [&](int j) -> void* {
        return flat ? (uint8_t*)r.output.data_ptr() + (size_t)j * bytes : r.list[j].data_ptr();
      };
      if (bytes == 0) {
        agree_with_all();
        break;
      }
      if (block(me) != r.tensor.data_ptr()) op->copies.emplace_back(block(me), r.tensor.data_ptr(), bytes);
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        Part& p = add_part(d.ranks[j]);
        p.sends.emplace_back(r.tensor.data_ptr(), bytes);
        p.recvs.emplace_back(block(j), bytes);
      }
      break;
    }
    case OpKind::kReduceScatter:
    case OpKind::kReduceScatterTensor: {
      const bool flat = r.kind == OpKind::kReduceScatterTensor;
      if (!flat)
        for (size_t j = 0; j < r.list.size(); ++j)
          TORCH_CHECK_VALUE(r.list[j].numel() == r.output.numel(), "fastcomm.", api, ": rank ", rank_, ", group ",
                            d.label, ": argument 'input_list[", j, "]' has ", r.list[j].numel(),
                            " elements, expected ", r.output.numel(), ": on ", r.output.device().type(),
                            " tensors every block must be the output's size (uneven blocks run on CPU tensors)");
      op->keep = flat ? std::vector<at::Tensor>{r.tensor, r.output} : r.list;
      if (!flat) op->keep.push_back(r.output);
      const size_t bytes = r.output.nbytes();
      sig.bytes = bytes;
      auto block = [&](int j) -> void* {
        return flat ? (uint8_t*)r.tensor.data_ptr() + (size_t)j * bytes : r.list[j].data_ptr();
      };
      if (bytes == 0) {
        agree_with_all();
        break;
      }
      if (n == 1) {
        if (block(0) != r.output.data_ptr()) op->copies.emplace_back(r.output.data_ptr(), block(0), bytes);
        break;
      }
      op->scratch = rt.scratch((int64_t)(n - 1) * r.output.numel(), r.output, how.join);
      auto* s = (uint8_t*)op->scratch.data_ptr();
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        Part& p = add_part(d.ranks[j]);
        p.sends.emplace_back(block(j), bytes);
        p.recvs.emplace_back(s + slot(j) * bytes, bytes);
      }
      op->folds.push_back(
          FoldJob{r.output.data_ptr(), block(me), s, r.output.numel(), n, me, r.output.scalar_type(), r.redop});
      break;
    }
    case OpKind::kSend:
    case OpKind::kRecv: {
      op->keep = {r.tensor};
      sig.bytes = r.tensor.nbytes();
      Part& p = add_part(r.peer);
      if (sig.bytes == 0) break;
      if (r.kind == OpKind::kSend) p.sends.emplace_back(r.tensor.data_ptr(), sig.bytes);
      else p.recvs.emplace_back(r.tensor.data_ptr(), sig.bytes);
      break;
    }
    case OpKind::kReduce: {
      // The root folds every member's tensor into its own; the others only send theirs.
      op->keep = {r.tensor};
      const int root = group_rank(r.peer);
      const size_t bytes = r.tensor.nbytes();
      sig.bytes = bytes;
      sig.root = root;
      if (n == 1) break;
      if (me != root) {
        Part& p = add_part(d.ranks[root]);
        if (bytes) p.sends.emplace_back(r.tensor.data_ptr(), bytes);
        break;
      }
      if (bytes == 0) {
        agree_with_all();
        break;
      }
      op->scratch = rt.scratch((int64_t)(n - 1) * r.tensor.numel(), r.tensor, how.join);
      auto* s = (uint8_t*)op->scratch.data_ptr();
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        add_part(d.ranks[j]).recvs.emplace_back(s + slot(j) * bytes, bytes);
      }
      op->folds.push_back(FoldJob{r.tensor.data_ptr(), r.tensor.data_ptr(), s, r.tensor.numel(), n, me,
                                  r.tensor.scalar_type(), r.redop});
      break;
    }
    case OpKind::kGather:
    case OpKind::kScatter: {
      // The root exchanges one block with each member (`list`, on the root only); its own is a
      // local copy.
      const bool gather = r.kind == OpKind::kGather;
      op->keep = r.list;
      op->keep.push_back(r.tensor);
      const int root = group_rank(r.peer);
      const size_t bytes = r.tensor.nbytes();
      sig.bytes = bytes;
      sig.root = root;
      if (me != root) {
        Part& p = add_part(d.ranks[root]);
        if (bytes && gather) p.sends.emplace_back(r.tensor.data_ptr(), bytes);
        if (bytes && !gather) p.recvs.emplace_back(r.tensor.data_ptr(), bytes);
        break;
      }
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        Part& p = add_part(d.ranks[j]);
        if (bytes && gather) p.recvs.emplace_back(r.list[j].data_ptr(), bytes);
        if (bytes && !gather) p.sends.emplace_back(r.list[j].data_ptr(), bytes);
      }
      void* mine = r.list[me].data_ptr();
      if (bytes && mine != r.tensor.data_ptr()) {
        if (gather) op->copies.emplace_back(mine, r.tensor.data_ptr(), bytes);
        else op->copies.emplace_back(r.tensor.data_ptr(), mine, bytes);
      }
      break;
    }
    case OpKind::kAllToAll:
    case OpKind::kAllToAllSingle: {
      // One part with every other member, each with its own sizes (both sides agree on them:
      // what one sends is what the other receives), a zero-byte one too.
      std::vector<std::pair<const void*, size_t>> in;
      std::vector<std::pair<void*, size_t>> out;
      if (r.kind == OpKind::kAllToAll) {
        op->keep = r.list;
        op->keep.insert(op->keep.end(), r.inputs.begin(), r.inputs.end());
        for (int j = 0; j < n; ++j) {
          in.emplace_back(r.inputs[j].data_ptr(), r.inputs[j].nbytes());
          out.emplace_back(r.list[j].data_ptr(), r.list[j].nbytes());
        }
      } else {
        op->keep = {r.tensor, r.output};
        const auto in_b = split_bytes(r.tensor, r.input_splits, n), out_b = split_bytes(r.output, r.output_splits, n);
        size_t a = 0, b = 0;
        for (int j = 0; j < n; ++j) {
          in.emplace_back((const uint8_t*)r.tensor.data_ptr() + a, in_b[j]);
          out.emplace_back((uint8_t*)r.output.data_ptr() + b, out_b[j]);
          a += in_b[j];
          b += out_b[j];
        }
      }
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        Part& p = add_part(d.ranks[j]);
        p.sig.bytes = in[j].second;
        p.sig.back = out[j].second;
        if (in[j].second) p.sends.push_back(in[j]);
        if (out[j].second) p.recvs.push_back(out[j]);
      }
      if (in[me].second && in[me].first != out[me].first) op->copies.emplace_back(out[me].first, in[me].first, in[me].second);
      op->parts_left = op->parts_unlaunched = (int)op->parts.size();
      return op;  // each part keeps its own signature
    }
    default:
      TORCH_CHECK_VALUE(false, "fastcomm.", api, ": rank ", rank_, ", group ", d.label, ": not supported for ",
                        dev.type(), " tensors");
  }
  for (auto& p : op->parts) p->sig = sig;  // sig.bytes/root were filled in after the parts
  op->parts_left = op->parts_unlaunched = (int)op->parts.size();
  return op;
}

}  // namespace device
}  // namespace fastcomm
