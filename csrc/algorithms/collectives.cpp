// The collectives, each written as one or two Exchanges (algorithms/exchange.h).
//
// Algorithm choice depends only on what every member agrees on (group size, dtype, numel), so
// all members always pick the same one:
//  - groups of 2, and small messages in any group: one-shot, a single exchange in which every
//    member sends its data to every other and folds what it receives;
//  - larger messages in groups of 3+: reduce-scatter then all-gather, so each member reduces
//    1/k of the data and the bytes each one sends stay ~2x the tensor instead of (k-1)x;
//  - all_reduce and barrier in a group that spans hosts with several members on at least one
//    host: hierarchical (make_hierarchical below), so that only one member per host talks
//    across hosts.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "algorithms/collectives.h"
#include "algorithms/direct.h"
#include "algorithms/exchange.h"
#include "algorithms/op.h"
#include "algorithms/reduce.h"
#include "algorithms/request.h"
#include "common/errors.h"

namespace fastcomm {
namespace {


ExchangePlan blank_plan(int size) {
  ExchangePlan p;
  p.send.resize(size);
  p.recv.resize(size);
  return p;
}

// The tensors an op holds: one in the common case, kept inline (no allocation per op).
using Tensors = c10::SmallVector<at::Tensor, 1>;

Tensors tensors(c10::ArrayRef<at::Tensor> ts) { return Tensors(ts.begin(), ts.end()); }

struct NoLocal {
  void operator()() const {}
};

// An op that is a fixed sequence of exchanges, built lazily because piece size comes from
// the transport. `keep` holds every tensor the op touches alive until it completes. `build`
// and `local` are the maker's lambdas, held as themselves: as std::functions their captures
// would cost heap blocks per op, and the op a size past malloc's per-thread cache.
template <typename Build, typename Local>
class PhasedOp final : public Op {
 public:
  PhasedOp(OpDesc d, Tensors outputs, Tensors keep, int rank, int size, int phases, size_t elem_size, Build build,
           Local local)
      : Op(d),
        outputs_(std::move(outputs)),
        keep_(std::move(keep)),
        rank_(rank),
        size_(size),
        phases_(phases),
        es_(elem_size),
        build_(std::move(build)),
        local_(std::move(local)) {}

  bool step(Comm& c) override {
    bool any = false;
    for (;;) {
      if (phase_ == phases_) return any;
      if (!started_) {
        if (phase_ == 0) local_();
        ex_.start(build_(phase_), rank_, size_, es_, c, outputs_, keep_);
        started_ = true;
        any = true;
      }
      any |= ex_.step(c);
      if (!ex_.done()) return any;
      ++phase_;
      started_ = false;
    }
  }
  bool done() const override { return phase_ == phases_; }
  void append_outputs(std::vector<at::Tensor>& out) const override {
    out.insert(out.end(), outputs_.begin(), outputs_.end());
  }
  bool restartable() const override { return true; }
  void restart() override {
    phase_ = 0;
    started_ = false;
  }
  void awaiting(std::vector<int>& group_ranks) const override {
    if (started_) ex_.awaiting(group_ranks);
  }

 private:
  Tensors outputs_, keep_;
  int rank_, size_, phases_;
  size_t es_;
  Build build_;
  Local local_;
  Exchange ex_;
  int phase_ = 0;
  bool started_ = false;
};

// `build(phase)` returns the ExchangePlan of that phase; `local()` runs before phase 0.
template <typename Build, typename Local = NoLocal>
std::unique_ptr<Op> phased(OpDesc d, Tensors outputs, Tensors keep, int rank, int size, int phases, size_t es,
                           Build build, Local local = {}) {
  return std::make_unique<PhasedOp<Build, Local>>(d, std::move(outputs), std::move(keep), rank, size, phases, es,
                                                  std::move(build), std::move(local));
}

// Element range [begin, end) of chunk r when n elements are split over k members.
std::pair<size_t, size_t> chunk(size_t n, int k, int r) {
  return {n * (size_t)r / (size_t)k, n * (size_t)(r + 1) / (size_t)k};
}

// Hierarchical all_reduce (and barrier, the same with no data) over a group spread across
// hosts: members fold into their host's leader over shared memory (phase 0), leaders all-reduce
// the host partials over Gloo (one-shot, or reduce-scatter + all-gather among 3+ leaders for
// large spans), leaders copy the result back (last phase). Only leaders talk across hosts.
// Tags carry the leaders' form, so members that disagree on the settings fail from phase 0
// (docs/design.md).
constexpr uint32_t kHierTag = 0x100;
constexpr uint32_t kHierSplitTag = 0x10;

std::unique_ptr<Op> make_hierarchical(OpDesc d, const at::Tensor& t, bool reduce, RedOp op, const GroupView& g) {
  const int rank = g.rank, size = g.size();
  const HostLayout& L = *g.hosts;
  const int my_leader = L.leader[rank];
  const bool leading = my_leader == rank;
  std::vector<int> locals;  // the members this rank leads, besides itself
  for (int q = 0; leading && q < size; ++q)
    if (q != rank && L.leader[q] == rank) locals.push_back(q);
  const int H = (int)L.leaders.size();
  const int li = (int)(std::find(L.leaders.begin(), L.leaders.end(), rank) - L.leaders.begin());
  uint8_t* base = t.defined() ? bytes(t) : nullptr;
  const size_t total = t.defined() ? nbytes(t) : 0;
  const size_t es = t.defined() ? t.element_size() : 1;
  const size_t n = t.defined() ? (size_t)t.numel() : 0;
  const bool split = reduce && H >= 3 && total >= g.rsag_threshold;
  const int phases = split ? 4 : 3;
  auto leader_chunk = [=](int j) {
    auto [b, e] = chunk(n, H, j);
    return Span::of(base + b * es, (e - b) * es);
  };
  const c10::ScalarType dtype = d.dtype;
  auto fold_into = [=](ExchangePlan& p, Span out, RedOp rop, int divisor) {
    p.fold = true;
    p.out = out;
    p.own = out.ptr;
    p.dtype = dtype;
    p.op = rop;
    p.avg_divisor = divisor;
  };
  Tensors outputs;
  if (t.defined()) outputs.push_back(t);
  return phased(d, std::move(outputs), Tensors{}, rank, size, phases, es,
      [=](int phase) {
        ExchangePlan p = blank_plan(size);
        // The form is in the tag too (members that disagree on FASTCOMM_RSAG_THRESHOLD differ
        // from phase 0 on, where every member's message reaches its leader).
        p.tag = kHierTag + (split ? kHierSplitTag : 0) + phase;
        p.watch_all = true;
        const Span all = Span::of(base, total);
        const Span none = Span::of(nullptr, 0);
        if (phase == 0) {  // members to their leader
          if (!leading) {
            p.send[my_leader] = all;
          } else {
            for (int q : locals) {
              if (reduce) p.recv[q].active = true;
              else p.recv[q] = none;
            }
            if (reduce && !locals.empty()) fold_into(p, all, op == RedOp::AVG ? RedOp::SUM : op, 1);
          }
          return p;
        }
        if (phase == phases - 1) {  // leaders to their members
          if (leading) {
            for (int q : locals) p.send[q] = all;
          } else {
            p.recv[my_leader] = all;
          }
          return p;
        }
        if (!leading) return p;  // the leaders' phases: nothing for the others
        for (int j = 0; j < H; ++j) {
          const int q = L.leaders[j];
          if (q == rank) continue;
          if (!split) {
            p.send[q] = all;
            if (reduce) p.recv[q].active = true;
            else p.recv[q] = none;
          } else if (phase == 1) {  // reduce-scatter: leader j folds chunk j
            p.send[q] = leader_chunk(j);
            p.recv[q].active = true;
          } else {  // all-gather of the folded chunks
            p.send[q] = leader_chunk(li);
            p.recv[q] = leader_chunk(j);
          }
        }
        if (reduce && !split) {
          fold_into(p, all, op, size);
          p.send_aliases_out = true;
        } else if (split && phase == 1) {
          fold_into(p, leader_chunk(li), op, size);
        }
        return p;
      });
}

std::unique_ptr<Op> make_flat_all_reduce(OpDesc d, const at::Tensor& t, RedOp op, const GroupView& g) {
  const int rank = g.rank, size = g.size();
  const size_t es = t.element_size();
  const c10::ScalarType dtype = t.scalar_type();  // (the lambdas hold no tensor)
  uint8_t* base = bytes(t);
  const size_t total = nbytes(t);
  if (size >= 3 && total >= g.rsag_threshold) {
    const size_t n = t.numel();
    auto span_of = [=](int r) {
      auto [b, e] = chunk(n, size, r);
      return Span::of(base + b * es, (e - b) * es);
    };
    return phased(d, Tensors{t}, Tensors{}, rank, size, 2, es,
        [=](int phase) {
          ExchangePlan p = blank_plan(size);
          p.tag = phase;
          for (int q = 0; q < size; ++q) {
            if (q == rank) continue;
            if (phase == 0) {  // reduce-scatter: chunk q goes to q, we fold chunk `rank`
              p.send[q] = span_of(q);
              p.recv[q].active = true;
            } else {  // all-gather of the reduced chunks
              p.send[q] = span_of(rank);
              p.recv[q] = span_of(q);
            }
          }
          if (phase == 0) {
            p.fold = true;
            p.out = span_of(rank);
            p.own = p.out.ptr;
            p.dtype = dtype;
            p.op = op;
            p.avg_divisor = size;
          }
          return p;
        });
  }
  return phased(d, Tensors{t}, Tensors{}, rank, size, 1, es,
      [=](int) {
        ExchangePlan p = blank_plan(size);
        for (int q = 0; q < size; ++q) {
          if (q == rank) continue;
          p.send[q] = Span::of(base, total);
          p.recv[q].active = true;
        }
        p.fold = true;
        p.out = Span::of(base, total);
        p.own = base;
        p.send_aliases_out = true;
        p.dtype = dtype;
        p.op = op;
        p.avg_divisor = size;
        return p;
      });
}

// A small all_reduce in a pair on one host. Its messages are the one-shot exchange's (one
// piece each way, tag 0, offset 0), so the peer may run either; this skips the exchange's
// bookkeeping, most of such an op's own cost. Each side folds the peer's data into its own,
// as the exchange does in a pair (the sides can differ only where op is not symmetric bit for
// bit: MIN or MAX of -0.0 and +0.0, NaN payloads).
class PairAllReduce final : public Op {
 public:
  PairAllReduce(OpDesc d, const at::Tensor& t, int rank)
      : Op(d), t_(t), data_(bytes(t)), len_((uint32_t)nbytes(t)), peer_(1 - rank) {}

  bool step(Comm& c) override {
    if (done_) return false;
    bool any = false;
    if (!sent_) {
      if (!c.send(peer_, 0, 0, data_, len_)) {
        c.check_abort(peer_);  // a peer that failed this op may never read its ring again
        return false;
      }
      sent_ = any = true;
    }
    const Message* m = c.peek(peer_);
    if (m == nullptr) return any;
    const Header& h = m->hdr;
    if ((h.flags & kMsgBulk) || h.tag != 0 || h.offset != 0 || h.len != len_)
      throw_comm_error("fastcomm: group rank " + std::to_string(peer_) + " sent a piece (phase tag " +
                       std::to_string(h.tag) + ", offset " + std::to_string(h.offset) + ", " +
                       std::to_string(h.len) + " bytes) where group rank " + std::to_string(1 - peer_) +
                       " expects the whole tensor in one piece: the members run different algorithms for this "
                       "op; FASTCOMM_SHM_RING_BYTES and FASTCOMM_SHM_DIRECT_BYTES must be the same on every rank");
    const size_t n = (size_t)desc_.numel;
    if (n) reduce_into(data_, m->data, n, desc_.dtype, desc_.redop);
    c.pop(peer_);
    if (desc_.redop == RedOp::AVG) divide_by(data_, n, desc_.dtype, 2);
    done_ = true;
    return true;
  }
  bool done() const override { return done_; }
  void append_outputs(std::vector<at::Tensor>& out) const override { out.push_back(t_); }
  bool restartable() const override { return true; }
  void restart() override { sent_ = done_ = false; }
  void awaiting(std::vector<int>& group_ranks) const override {
    if (!done_) group_ranks.push_back(peer_);
  }

 private:
  at::Tensor t_;
  uint8_t* data_;
  uint32_t len_;
  int peer_;
  bool sent_ = false, done_ = false;
};

}  // namespace

std::unique_ptr<Op> make_all_reduce(const OpRequest& r, const GroupView& g) {
  const at::Tensor& t = r.tensor;
  OpDesc d{OpKind::kAllReduce, t.scalar_type(), r.redop, (uint64_t)t.numel(), -1};
  if (g.hosts) return make_hierarchical(d, t, true, r.redop, g);
  if (g.size() == 2 && nbytes(t) <= g.pair_message_max) return std::make_unique<PairAllReduce>(d, t, g.rank);
  auto flat = make_flat_all_reduce(d, t, r.redop, g);
  if (g.size() >= 2 && nbytes(t) >= g.direct_min)
    return make_direct_all_reduce(d, t, g.rank, g.size(), std::move(flat));
  return flat;
}

std::unique_ptr<Op> make_broadcast(const at::Tensor& t, int root, int rank, int size) {
  OpDesc d{OpKind::kBroadcast, t.scalar_type(), RedOp::SUM, (uint64_t)t.numel(), root};
  uint8_t* base = bytes(t);
  const size_t total = nbytes(t);
  // Non-roots answer with an empty message: the root then knows every member issued the same
  // broadcast (or learns of a mismatch) before it reports completion.
  return phased(d, Tensors{t}, Tensors{}, rank, size, 1,
      t.element_size(), [=](int) {
        ExchangePlan p = blank_plan(size);
        for (int q = 0; q < size; ++q) {
          if (q == rank) continue;
          if (rank == root) {
            p.send[q] = Span::of(base, total);
            p.recv[q] = Span::of(nullptr, 0);
          } else if (q == root) {
            p.send[q] = Span::of(nullptr, 0);
            p.recv[q] = Span::of(base, total);
          }
        }
        return p;
      });
}

// `outs`: member q's block; `reported`: what the op hands the caller's future (the blocks
// themselves, or the one tensor they are views of).
std::unique_ptr<Op> make_all_gather(const std::vector<at::Tensor>& outs, const at::Tensor& in,
                                    int rank, int size, std::vector<at::Tensor> reported) {
  OpDesc d{OpKind::kAllGather, in.scalar_type(), RedOp::SUM, (uint64_t)in.numel(), -1};
  uint8_t* src = bytes(in);
  const size_t len = nbytes(in);
  std::vector<uint8_t*> dst;
  for (const auto& o : outs) dst.push_back(bytes(o));
  return phased(d, tensors(reported), Tensors{in}, rank, size, 1, in.element_size(),
      [=](int) {
        ExchangePlan p = blank_plan(size);
        for (int q = 0; q < size; ++q) {
          if (q == rank) continue;
          p.send[q] = Span::of(src, len);
          p.recv[q] = Span::of(dst[q], len);
        }
        return p;
      },
      [=] {
        if (len && dst[rank] != src) std::memmove(dst[rank], src, len);
      });
}

std::unique_ptr<Op> make_reduce_scatter(const at::Tensor& out, const std::vector<at::Tensor>& ins,
                                        RedOp op, int rank, int size, std::string label) {
  std::vector<uint8_t*> src;
  std::vector<size_t> sends;
  uint64_t total = 0;
  for (const auto& i : ins) {
    src.push_back(bytes(i));
    sends.push_back(nbytes(i));
    total += (uint64_t)i.numel();
  }
  uint8_t* dst = bytes(out);
  const size_t len = nbytes(out);
  // The header holds the blocks' total (the same on every member whether the blocks are even or
  // not), and each pair checks the two sizes it exchanges, so members that disagree fail naming
  // each other.
  OpDesc d{OpKind::kReduceScatter, out.scalar_type(), op, total, -1};
  return phased(d, Tensors{out}, tensors(ins), rank, size, 1, out.element_size(),
      [=](int) {
        ExchangePlan p = blank_plan(size);
        for (int q = 0; q < size; ++q) {
          if (q == rank) continue;
          p.send[q] = Span::of(src[q], sends[q]);
          p.recv[q].active = true;
          p.recv[q].len = len;  // (a fold receives into `out`; the length is for pair_sizes)
        }
        p.pair_sizes = true;
        p.label = label;
        p.fold = true;
        p.out = Span::of(dst, len);
        p.own = src[rank];
        p.dtype = out.scalar_type();
        p.op = op;
        p.avg_divisor = size;
        return p;
      });
}

std::unique_ptr<Op> make_barrier(const OpRequest&, const GroupView& g) {
  const int rank = g.rank, size = g.size();
  OpDesc d{OpKind::kBarrier, c10::ScalarType::Byte, RedOp::SUM, 0, -1};
  if (g.hosts) return make_hierarchical(d, at::Tensor(), false, RedOp::SUM, g);
  return phased(d, Tensors{}, Tensors{}, rank, size, 1, 1,
      [=](int) {
        ExchangePlan p = blank_plan(size);
        for (int q = 0; q < size; ++q) {
          if (q == rank) continue;
          p.send[q] = Span::of(nullptr, 0);
          p.recv[q] = Span::of(nullptr, 0);
        }
        return p;
      });
}

std::unique_ptr<Op> make_p2p(const at::Tensor& t, bool sending, int peer_rank, int rank) {
  // Both sides describe the op alike (kind kSend) so the header check compares dtype and numel.
  OpDesc d{OpKind::kSend, t.scalar_type(), RedOp::SUM, (uint64_t)t.numel(), -1};
  uint8_t* base = bytes(t);
  const size_t len = nbytes(t);
  return phased(d, Tensors{t}, Tensors{}, rank, 2, 1,
      t.element_size(), [=](int) {
        ExchangePlan p = blank_plan(2);
        p.bulk = false;
        if (sending) p.send[peer_rank] = Span::of(base, len);
        else p.recv[peer_rank] = Span::of(base, len);
        return p;
      });
}

// The rooted collectives are one exchange each. Every member that does not otherwise hear from
// the root gets an empty message from it (and the root one from every member that does not
// otherwise send to it), so the root and each member see each other's header: one that issued
// something else fails, and so does its partner (docs/design.md).

// Non-roots send their tensor to the root, which folds in group-rank order into its own.
std::unique_ptr<Op> make_reduce(const at::Tensor& t, int root, RedOp op, int rank, int size) {
  OpDesc d{OpKind::kReduce, t.scalar_type(), op, (uint64_t)t.numel(), root};
  uint8_t* base = bytes(t);
  const size_t total = nbytes(t);
  return phased(d, Tensors{t}, Tensors{}, rank, size, 1,
      t.element_size(), [=](int) {
        ExchangePlan p = blank_plan(size);
        if (rank != root) {
          p.send[root] = Span::of(base, total);
          p.recv[root] = Span::of(nullptr, 0);
          return p;
        }
        for (int q = 0; q < size; ++q) {
          if (q == rank) continue;
          p.send[q] = Span::of(nullptr, 0);
          p.recv[q].active = true;
        }
        p.fold = true;
        p.out = Span::of(base, total);
        p.own = base;
        p.dtype = t.scalar_type();
        p.op = op;
        p.avg_divisor = size;
        return p;
      });
}

// gather (to_root) and scatter: the root's block q is group rank q's `t`.
std::unique_ptr<Op> make_rooted_copy(OpKind kind, const at::Tensor& t, const std::vector<at::Tensor>& blocks,
                                     int root, int rank, int size) {
  const bool to_root = kind == OpKind::kGather;
  OpDesc d{kind, t.scalar_type(), RedOp::SUM, (uint64_t)t.numel(), root};
  uint8_t* mine = bytes(t);
  const size_t len = nbytes(t);
  std::vector<uint8_t*> blk;
  for (const auto& b : blocks) blk.push_back(bytes(b));
  std::vector<at::Tensor> outputs = to_root ? blocks : std::vector<at::Tensor>{t};
  std::vector<at::Tensor> keep = to_root ? std::vector<at::Tensor>{t} : blocks;
  return phased(d, tensors(outputs), tensors(keep), rank, size, 1, t.element_size(),
      [=](int) {
        ExchangePlan p = blank_plan(size);
        const Span none = Span::of(nullptr, 0);
        for (int q = 0; q < size; ++q) {
          if (q == rank || (rank != root && q != root)) continue;
          const Span data = Span::of(rank == root ? blk[q] : mine, len);
          const bool sending = (rank == root) != to_root;
          p.send[q] = sending ? data : none;
          p.recv[q] = sending ? none : data;
        }
        return p;
      },
      [=] {
        if (rank != root || len == 0 || blk[rank] == mine) return;
        if (to_root) std::memmove(blk[rank], mine, len);
        else std::memmove(mine, blk[rank], len);
      });
}

// Every member sends send[q] to q and receives recv[q] from it; the pair's lengths travel in
// the tags (ExchangePlan::pair_sizes), so the header holds no size (numel 0).
std::unique_ptr<Op> make_all_to_all(std::vector<Span> send, std::vector<Span> recv, std::vector<at::Tensor> outputs,
                                    std::vector<at::Tensor> keep, c10::ScalarType dtype, size_t es, const GroupView& g,
                                    OpKind api) {
  const int rank = g.rank, size = g.size();
  OpDesc d{OpKind::kAllToAll, dtype, RedOp::SUM, 0, -1};
  const std::string label = std::string("fastcomm.") + op_kind_name(api) + ": rank " +
                            std::to_string(g.global_rank) + ", group " + g.label();
  const Span own_in = send[rank], own_out = recv[rank];
  return phased(d, tensors(outputs), tensors(keep), rank, size, 1, es,
      [=](int) {
        ExchangePlan p = blank_plan(size);
        for (int q = 0; q < size; ++q) {
          if (q == rank) continue;
          p.send[q] = send[q];
          p.recv[q] = recv[q];
        }
        p.pair_sizes = true;
        p.label = label;
        return p;
      },
      [=] {
        if (own_in.len && own_in.ptr != own_out.ptr) std::memmove(own_out.ptr, own_in.ptr, own_in.len);
      });
}

}  // namespace fastcomm
