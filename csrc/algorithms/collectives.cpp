// The collectives, each written as one or two Exchanges (algorithms/exchange.h).
//
// Algorithm choice depends only on what every member agrees on (group size, dtype, numel), so
// all members always pick the same one:
//  - groups of 2, and small messages in any group: one-shot, a single exchange in which every
//    member sends its data to every other and folds what it receives;
//  - larger messages in groups of 3+: reduce-scatter then all-gather, so each member reduces
//    1/k of the data and the bytes each one sends stay ~2x the tensor instead of (k-1)x.
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

}  // namespace

std::unique_ptr<Op> make_all_reduce(const at::Tensor& t, RedOp op, int rank, int size) {
  OpDesc d{OpKind::kAllReduce, t.scalar_type(), op, (uint64_t)t.numel(), -1};
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

std::unique_ptr<Op> make_barrier(int rank, int size) {
  OpDesc d{OpKind::kBarrier, c10::ScalarType::Byte, RedOp::SUM, 0, -1};
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
