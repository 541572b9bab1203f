#include "algorithms/exchange.h"

#include <algorithm>
#include <cstring>

#include "algorithms/reduce.h"
#include "common/errors.h"

namespace fastcomm {

// Streams at least this large are published before the reduce work of the same step, so the
// peer can start on them meanwhile; smaller sends wait for the end of the progress pass.
constexpr size_t kEarlyFlushBytes = 64 * 1024;

void Exchange::start(ExchangePlan plan, int rank, int size, size_t elem_size, size_t max_payload) {
  plan_ = std::move(plan);
  rank_ = rank;
  size_ = size;
  es_ = std::max<size_t>(1, elem_size);
  piece_ = std::max(es_, (max_payload / es_) * es_);
  sent_.assign(size, 0);
  recvd_.assign(size, 0);
  send_total_.assign(size, 0);
  recv_total_.assign(size, 0);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    if (plan_.send[p].active) send_total_[p] = pieces(plan_.send[p].len);
    if (plan_.recv[p].active) recv_total_[p] = pieces(plan_.fold ? plan_.out.len : plan_.recv[p].len);
  }
  if (plan_.fold) {
    fold_total_ = pieces(plan_.out.len);
    // Folding overwrites `out`; when what we send lives there, a piece must have gone to every
    // peer before it is overwritten (checked in step). When our own contribution lives in
    // `out`, order-independent folds may go straight into it; otherwise a piece-sized
    // accumulator keeps the group-rank order.
    inplace_ = plan_.own == plan_.out.ptr;
    direct_ = (size_ == 2 && inplace_) || order_independent(plan_.dtype, plan_.op);
    if (inplace_ && !direct_) tmp_.resize(std::min(piece_, plan_.out.len));
  }
  done_ = false;
}

bool Exchange::step(Comm& c) {
  if (done_) return false;
  bool any = false;
  // Sends first: they unblock peers, and in-place folding may not overtake them.
  size_t min_sent = SIZE_MAX;
  size_t sent_bytes = 0;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || send_total_[p] == 0) continue;
    const Span& s = plan_.send[p];
    while (sent_[p] < send_total_[p]) {
      const size_t off = sent_[p] * piece_;
      const uint32_t len = (uint32_t)std::min(piece_, s.len - std::min(s.len, off));
      if (!c.send(p, off, plan_.tag, s.ptr + off, len)) break;
      ++sent_[p];
      sent_bytes += len;
      any = true;
    }
    if (sent_[p] < send_total_[p]) min_sent = std::min(min_sent, sent_[p]);
  }
  if (sent_bytes >= kEarlyFlushBytes) c.flush();
  if (plan_.fold) {
    while (folded_ < fold_total_ && (!plan_.send_aliases_out || folded_ < min_sent)) {
      if (!fold_piece(c)) break;
      any = true;
    }
  } else {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const Span& d = plan_.recv[p];
      while (recvd_[p] < recv_total_[p]) {
        const Message* m = c.peek(p);
        if (m == nullptr) break;
        const size_t off = recvd_[p] * piece_;
        TORCH_INTERNAL_ASSERT(m->hdr.tag == plan_.tag && m->hdr.offset == off &&
                                  off + m->hdr.len <= std::max(d.len, off),
                              "exchange: unexpected piece from group rank ", p);
        if (m->hdr.len) std::memcpy(d.ptr + off, m->data, m->hdr.len);
        c.pop(p);
        ++recvd_[p];
        any = true;
      }
    }
  }
  bool finished = true;
  for (int p = 0; p < size_ && finished; ++p)
    finished = sent_[p] == send_total_[p] && (plan_.fold || recvd_[p] == recv_total_[p]);
  if (finished && (!plan_.fold || folded_ == fold_total_)) done_ = true;
  return any;
}

void Exchange::fold_from(const uint8_t* src, uint8_t* dst, size_t n) {
  if (!acc_started_) {
    if (dst != src) std::memcpy(dst, src, n * es_);
    acc_started_ = true;
  } else {
    reduce_into(dst, src, n, plan_.dtype, plan_.op);
  }
}

// Folds the contributions of group ranks fold_next_.. into piece folded_; returns false when
// one has not arrived yet (the fold resumes there on a later step).
bool Exchange::fold_piece(Comm& c) {
  const size_t off = folded_ * piece_;
  const size_t len = std::min(piece_, plan_.out.len - std::min(plan_.out.len, off));
  const size_t n = len / es_;
  uint8_t* out = plan_.out.ptr + off;
  uint8_t* acc = (inplace_ && !direct_) ? tmp_.data() : out;
  if (direct_ && inplace_) acc_started_ = true;  // own data already sits in out
  for (; fold_next_ < size_; ++fold_next_) {
    const int r = fold_next_;
    if (r == rank_) {
      if (!(direct_ && inplace_)) fold_from(plan_.own + off, acc, n);
      continue;
    }
    if (!plan_.recv[r].active) continue;
    const Message* m = c.peek(r);
    if (m == nullptr) return false;
    TORCH_INTERNAL_ASSERT(m->hdr.tag == plan_.tag && m->hdr.offset == off && m->hdr.len == len,
                          "exchange: unexpected piece from group rank ", r, " in a fold");
    fold_from(m->data, acc, n);
    c.pop(r);
  }
  if (acc != out) std::memcpy(out, acc, len);
  if (plan_.op == c10d::ReduceOp::AVG) divide_by(out, n, plan_.dtype, plan_.avg_divisor);
  fold_next_ = 0;
  acc_started_ = false;
  ++folded_;
  return true;
}

}  // namespace fastcomm
