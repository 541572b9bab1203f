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

#include "algorithms/exchange.h"
#include "algorithms/op.h"
#include "common/errors.h"

namespace fastcomm {
namespace {

using RedOp = c10d::ReduceOp::RedOpType;

uint8_t* bytes(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }
size_t nbytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

ExchangePlan blank_plan(int size) {
  ExchangePlan p;
  p.send.resize(size);
  p.recv.resize(size);
  return p;
}

// An op that is a fixed sequence of exchanges, built lazily because piece size comes from
// the transport. `keep` holds every tensor the op touches alive until it completes.
class PhasedOp final : public Op {
 public:
  using Builder = std::function<ExchangePlan(int phase)>;
  PhasedOp(OpDesc d, std::vector<at::Tensor> outputs, std::vector<at::Tensor> keep, int rank,
           int size, int phases, size_t elem_size, Builder build, std::function<void()> local = {})
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
        if (phase_ == 0 && local_) local_();
        std::vector<at::Tensor> owners(outputs_);
        owners.insert(owners.end(), keep_.begin(), keep_.end());
        ex_.start(build_(phase_), rank_, size_, es_, c, std::move(owners));
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
  std::vector<at::Tensor> outputs() const override { return outputs_; }

 private:
  std::vector<at::Tensor> outputs_, keep_;
  int rank_, size_, phases_;
  size_t es_;
  Builder build_;
  std::function<void()> local_;
  Exchange ex_;
  int phase_ = 0;
  bool started_ = false;
};

// Element range [begin, end) of chunk r when n elements are split over k members.
std::pair<size_t, size_t> chunk(size_t n, int k, int r) {
  return {n * (size_t)r / (size_t)k, n * (size_t)(r + 1) / (size_t)k};
}

size_t rsag_threshold() {
  static const size_t v = [] {
    const char* e = std::getenv("FASTCOMM_RSAG_THRESHOLD");
    return e && *e ? (size_t)std::atoll(e) : (size_t)256 * 1024;
  }();
  return v;
}

// Hierarchical all_reduce (and barrier, the same with no data) over a group spread across
// hosts. A message between hosts costs far more than one inside a host (a Gloo frame over TCP
// and a thread hand-off on each side, against a shared-memory ring), and the flat one-shot
// sends one from every member to every member on another host. Here:
//  0. each host's members send their data to the host's leader over shared memory, and the
//     leader folds them into its tensor (AVG is summed here, divided once in the next phase);
//  1. the leaders all-reduce those host partials among themselves over Gloo: one-shot, or, for
//     large spans among 3+ leaders, a reduce-scatter (1) and an all-gather (2) over chunks of
//     the tensor, one per leader;
//  last. each leader copies the result to its host's members.
// So one message crosses between each pair of hosts per op instead of one per pair of members,
// and members that do not lead talk to no other host at all. Every leader folds the same host
// partials in the same order, and the other members receive a leader's bytes, so all members
// get identical results (rounded in host order, not in the flat fold's member order).
// Mismatches are still caught: every member's header reaches its leader, every leader's
// reaches the other leaders, and whoever detects one tells the whole group; a member that
// issued another collective may have sent its messages elsewhere (a broadcast to a member of
// another host), so a phase that cannot move also looks at every member's next message
// (ExchangePlan::watch_all). The tags are kept apart from the flat algorithms' and carry the
// form of the leaders' phase, so that members which disagree on the algorithm
// (FASTCOMM_HIERARCHICAL or FASTCOMM_RSAG_THRESHOLD set differently) fail the op from phase 0
// on instead of folding the wrong pieces.
constexpr uint32_t kHierTag = 0x100;
constexpr uint32_t kHierSplitTag = 0x10;

std::unique_ptr<Op> make_hierarchical(OpDesc d, const at::Tensor& t, bool reduce, RedOp op, int rank,
                                      int size, std::shared_ptr<const HostLayout> hosts) {
  const HostLayout& L = *hosts;
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
  const bool split = reduce && H >= 3 && total >= rsag_threshold();
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
  std::vector<at::Tensor> outputs;
  if (t.defined()) outputs.push_back(t);
  return std::make_unique<PhasedOp>(d, outputs, std::vector<at::Tensor>{}, rank, size, phases, es,
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

}  // namespace

std::unique_ptr<Op> make_all_reduce(const at::Tensor& t, RedOp op, int rank, int size,
                                    std::shared_ptr<const HostLayout> hosts) {
  OpDesc d{OpKind::kAllReduce, t.scalar_type(), op, (uint64_t)t.numel(), -1};
  if (hosts) return make_hierarchical(d, t, true, op, rank, size, std::move(hosts));
  const size_t es = t.element_size();
  uint8_t* base = bytes(t);
  const size_t total = nbytes(t);
  if (size >= 3 && total >= rsag_threshold()) {
    const size_t n = t.numel();
    auto span_of = [=](int r) {
      auto [b, e] = chunk(n, size, r);
      return Span::of(base + b * es, (e - b) * es);
    };
    return std::make_unique<PhasedOp>(d, std::vector<at::Tensor>{t}, std::vector<at::Tensor>{}, rank, size, 2, es,
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
            p.dtype = t.scalar_type();
            p.op = op;
            p.avg_divisor = size;
          }
          return p;
        });
  }
  return std::make_unique<PhasedOp>(d, std::vector<at::Tensor>{t}, std::vector<at::Tensor>{}, rank, size, 1, es,
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
        p.dtype = t.scalar_type();
        p.op = op;
        p.avg_divisor = size;
        return p;
      });
}

std::unique_ptr<Op> make_broadcast(const at::Tensor& t, int root, int rank, int size) {
  OpDesc d{OpKind::kBroadcast, t.scalar_type(), RedOp::SUM, (uint64_t)t.numel(), root};
  uint8_t* base = bytes(t);
  const size_t total = nbytes(t);
  // Non-roots answer with an empty message: the root then knows every member issued the same
  // broadcast (or learns of a mismatch) before it reports completion.
  return std::make_unique<PhasedOp>(d, std::vector<at::Tensor>{t}, std::vector<at::Tensor>{}, rank, size, 1,
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

std::unique_ptr<Op> make_all_gather(const std::vector<at::Tensor>& outs, const at::Tensor& in,
                                    int rank, int size) {
  OpDesc d{OpKind::kAllGather, in.scalar_type(), RedOp::SUM, (uint64_t)in.numel(), -1};
  uint8_t* src = bytes(in);
  const size_t len = nbytes(in);
  std::vector<uint8_t*> dst;
  for (const auto& o : outs) dst.push_back(bytes(o));
  std::vector<at::Tensor> keep{in};
  return std::make_unique<PhasedOp>(d, outs, keep, rank, size, 1, in.element_size(),
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
                                        RedOp op, int rank, int size) {
  OpDesc d{OpKind::kReduceScatter, out.scalar_type(), op, (uint64_t)out.numel(), -1};
  std::vector<uint8_t*> src;
  for (const auto& i : ins) src.push_back(bytes(i));
  uint8_t* dst = bytes(out);
  const size_t len = nbytes(out);
  return std::make_unique<PhasedOp>(d, std::vector<at::Tensor>{out}, ins, rank, size, 1, out.element_size(),
      [=](int) {
        ExchangePlan p = blank_plan(size);
        for (int q = 0; q < size; ++q) {
          if (q == rank) continue;
          p.send[q] = Span::of(src[q], len);
          p.recv[q].active = true;
        }
        p.fold = true;
        p.out = Span::of(dst, len);
        p.own = src[rank];
        p.dtype = out.scalar_type();
        p.op = op;
        p.avg_divisor = size;
        return p;
      });
}

std::unique_ptr<Op> make_barrier(int rank, int size, std::shared_ptr<const HostLayout> hosts) {
  OpDesc d{OpKind::kBarrier, c10::ScalarType::Byte, RedOp::SUM, 0, -1};
  if (hosts) return make_hierarchical(d, at::Tensor(), false, RedOp::SUM, rank, size, std::move(hosts));
  return std::make_unique<PhasedOp>(d, std::vector<at::Tensor>{}, std::vector<at::Tensor>{}, rank, size, 1, 1,
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
  return std::make_unique<PhasedOp>(d, std::vector<at::Tensor>{t}, std::vector<at::Tensor>{}, rank, 2, 1,
      t.element_size(), [=](int) {
        ExchangePlan p = blank_plan(2);
        p.bulk = false;
        if (sending) p.send[peer_rank] = Span::of(base, len);
        else p.recv[peer_rank] = Span::of(base, len);
        return p;
      });
}

}  // namespace fastcomm
