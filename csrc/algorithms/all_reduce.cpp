// all_reduce for small groups: every member sends its tensor, in pieces, to every other member
// and folds what it receives into its own copy ("one-shot"). For a pair this is a single
// exchange plus a local reduce, the hot path of the whole project.
//
// Two rules keep results right and identical on every member:
//  - in place: a piece of our tensor is overwritten by the reduction only after it has been
//    sent to every peer, so peers always receive our original data;
//  - order: floating-point reductions are folded in group-rank order (x0 op x1 op ... op xk-1)
//    through a piece-sized accumulator, so every member rounds the same way. When the fold is
//    order-independent (integers, MIN/MAX, or any commutative op over two ranks) pieces are
//    folded straight into the tensor as they arrive.
#include <algorithm>
#include <cstring>

#include "algorithms/op.h"
#include "algorithms/reduce.h"
#include "common/errors.h"

namespace fastcomm {
namespace {

using RedOp = c10d::ReduceOp::RedOpType;

class AllReduceOneShot final : public Op {
 public:
  AllReduceOneShot(const at::Tensor& t, RedOp op, int rank, int size)
      : Op(OpDesc{OpKind::kAllReduce, t.scalar_type(), op, (uint64_t)t.numel(), -1}),
        t_(t),
        buf_(static_cast<uint8_t*>(t.data_ptr())),
        es_(t.element_size()),
        nbytes_(t.numel() * t.element_size()),
        rank_(rank),
        size_(size),
        sent_(size, 0),
        inplace_(size == 2 || order_independent(t.scalar_type(), op)) {}

  bool step(Comm& c) override {
    if (piece_ == 0) init(c);
    bool any = false;
    // Sends first: they unblock peers, and folding may not overtake them (in-place rule).
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      while (sent_[p] < npieces_) {
        const size_t off = sent_[p] * piece_;
        const uint32_t len = (uint32_t)std::min(piece_, nbytes_ - off);
        if (!c.send(p, off, 0, buf_ + off, len)) break;
        ++sent_[p];
        any = true;
      }
    }
    while (folded_ < npieces_ && folded_ < min_sent()) {
      if (!fold_piece(c)) break;
      any = true;
    }
    return any;
  }

  bool done() const override { return folded_ == npieces_ && min_sent() == npieces_; }
  std::vector<at::Tensor> outputs() const override { return {t_}; }

 private:
  void init(Comm& c) {
    piece_ = std::max<size_t>(es_, (c.max_payload() / es_) * es_);
    npieces_ = std::max<size_t>(1, (nbytes_ + piece_ - 1) / piece_);  // an empty op still talks
    if (size_ == 1) {
      folded_ = npieces_;
      std::fill(sent_.begin(), sent_.end(), npieces_);
    }
    if (!inplace_) tmp_.resize(std::min(piece_, nbytes_));
  }

  size_t min_sent() const {
    size_t m = npieces_;
    for (int p = 0; p < size_; ++p)
      if (p != rank_) m = std::min(m, sent_[p]);
    return m;
  }

  // Folds the contributions of ranks fold_next_.. into piece folded_; returns false when a
  // contribution has not arrived yet (the fold resumes there on a later step).
  bool fold_piece(Comm& c) {
    const size_t off = folded_ * piece_;
    const size_t len = nbytes_ ? std::min(piece_, nbytes_ - off) : 0;
    const size_t n = len / es_;
    uint8_t* own = buf_ + off;
    const c10::ScalarType dt = desc_.dtype;
    for (; fold_next_ < size_; ++fold_next_) {
      const int r = fold_next_;
      if (r == rank_) {
        if (!inplace_) fold_tmp(own, n);
        continue;
      }
      const Message* m = c.peek(r);
      if (m == nullptr) return false;
      TORCH_INTERNAL_ASSERT(m->hdr.offset == off && m->hdr.len == len,
                            "all_reduce: out-of-order piece from group rank ", r);
      if (inplace_) reduce_into(own, m->data, n, dt, desc_.redop);
      else fold_tmp(m->data, n);
      c.pop(r);
    }
    if (!inplace_) std::memcpy(own, tmp_.data(), len);
    if (desc_.redop == RedOp::AVG) divide_by(own, n, dt, size_);
    fold_next_ = 0;
    tmp_started_ = false;
    ++folded_;
    return true;
  }

  void fold_tmp(const void* src, size_t n) {
    if (!tmp_started_) {
      std::memcpy(tmp_.data(), src, n * es_);
      tmp_started_ = true;
    } else {
      reduce_into(tmp_.data(), src, n, desc_.dtype, desc_.redop);
    }
  }

  at::Tensor t_;
  uint8_t* buf_;
  size_t es_;
  size_t nbytes_;
  int rank_;
  int size_;
  size_t piece_ = 0;
  size_t npieces_ = 0;
  std::vector<size_t> sent_;  // pieces sent, per group rank
  size_t folded_ = 0;         // pieces fully reduced
  int fold_next_ = 0;         // next group rank to fold into the current piece
  bool inplace_;
  bool tmp_started_ = false;
  std::vector<uint8_t> tmp_;
};

}  // namespace

std::unique_ptr<Op> make_all_reduce(const at::Tensor& t, RedOp op, int rank, int size) {
  return std::make_unique<AllReduceOneShot>(t, op, rank, size);
}

}  // namespace fastcomm
