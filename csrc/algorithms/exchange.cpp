#include "algorithms/exchange.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "algorithms/reduce.h"
#include "common/errors.h"

namespace fastcomm {

// Streams at least this large are published before the reduce work of the same step, so the
// peer can start on them meanwhile; smaller sends wait for the end of the progress pass.
constexpr size_t kEarlyFlushBytes = 64 * 1024;

// Fold scratch for bulk receives is recycled: a fresh megabyte buffer per op costs page
// faults and zeroing (the allocator hands large blocks back to the kernel when they are
// freed), which is more than the fold itself. Buffers are kept by exact size (ops repeat their
// sizes), up to a bound in all; a buffer a transport still holds (a transfer abandoned when
// its op failed) is not taken back. Shared by every engine thread, hence the lock.
constexpr size_t kScratchPoolBytes = 64 << 20;

struct ScratchPool {
  std::mutex mu;
  std::unordered_map<size_t, std::vector<at::Tensor>> free;
  size_t bytes = 0;

  at::Tensor get(size_t n) {
    {
      std::lock_guard<std::mutex> lk(mu);
      auto it = free.find(n);
      if (it != free.end() && !it->second.empty()) {
        at::Tensor t = std::move(it->second.back());
        it->second.pop_back();
        bytes -= n;
        return t;
      }
    }
    return at::empty({(int64_t)n}, at::TensorOptions().dtype(at::kByte));
  }
  void put(at::Tensor t) {
    if (!t.defined() || t.use_count() != 1 || t.storage().use_count() != 1) return;
    const size_t n = (size_t)t.numel();
    std::lock_guard<std::mutex> lk(mu);
    if (bytes + n > kScratchPoolBytes) return;
    bytes += n;
    free[n].push_back(std::move(t));
  }
};

ScratchPool& scratch_pool() {
  static ScratchPool* pool = new ScratchPool;  // never destroyed: used until the process exits
  return *pool;
}

void Exchange::start(ExchangePlan plan, int rank, int size, size_t elem_size, Comm& c,
                     c10::ArrayRef<at::Tensor> owners, c10::ArrayRef<at::Tensor> more_owners) {
  plan_ = std::move(plan);
  rank_ = rank;
  size_ = size;
  es_ = std::max<size_t>(1, elem_size);
  piece_ = std::max(es_, (c.max_payload() / es_) * es_);
  owners_.clear();
  for (auto list : {owners, more_owners})
    for (const auto& t : list)
      if (t.defined() && t.has_storage()) owners_.push_back(t.storage());
  peer_.assign(size, Peer{});
  // An op's phases reuse one Exchange: nothing of the last phase's fold may carry over.
  folded_ = fold_total_ = 0;
  fold_next_ = 0;
  inplace_ = direct_ = acc_started_ = false;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const Span& s = plan_.send[p];
    const size_t bulk_min = c.bulk_min(p);
    peer_[p].bulk_from = bulk_min != SIZE_MAX;
    if (s.active) {
      peer_[p].bulk_send = plan_.bulk && s.len > 0 && s.len >= bulk_min;
      peer_[p].send_total = peer_[p].bulk_send ? 1 : pieces(s.len);  // a bulk span: one offer
    }
    if (plan_.recv[p].active) peer_[p].recv_total = pieces(plan_.fold ? plan_.out.len : plan_.recv[p].len);
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
    if (p == rank_ || peer_[p].send_total == 0) continue;
    const Span& s = plan_.send[p];
    if (peer_[p].bulk_send) {
      if (!peer_[p].bsend) {
        peer_[p].bsend = c.send_bulk(p, send_tag(p), bytes_of(s.ptr, s.len));
        if (!peer_[p].bsend) {
          min_sent = 0;
          continue;
        }
        peer_[p].sent = peer_[p].send_total;
        any = true;
      }
      // Nothing of the span may be overwritten until the transport has read all of it.
      if (!peer_[p].bsend->done()) min_sent = 0;
      continue;
    }
    while (peer_[p].sent < peer_[p].send_total) {
      const size_t off = peer_[p].sent * piece_;
      const uint32_t len = (uint32_t)std::min(piece_, s.len - std::min(s.len, off));
      if (!c.send(p, off, send_tag(p), s.ptr + off, len)) break;
      ++peer_[p].sent;
      sent_bytes += len;
      any = true;
    }
    if (peer_[p].sent < peer_[p].send_total) min_sent = std::min(min_sent, peer_[p].sent);
  }
  if (sent_bytes >= kEarlyFlushBytes) c.flush();
  any |= post_bulk_recvs(c);
  if (plan_.fold) {
    while (folded_ < fold_total_ && (!plan_.send_aliases_out || folded_ < min_sent)) {
      if (!fold_piece(c)) break;
      any = true;
    }
  } else {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || peer_[p].brecv) continue;
      const Span& d = plan_.recv[p];
      while (peer_[p].recvd < peer_[p].recv_total) {
        const Message* m = c.peek(p);
        if (m == nullptr) break;
        if (m->hdr.flags & kMsgBulk) {  // arrived since this step's post_bulk_recvs
          take_offer(c, p, *m);
          any = true;
          break;
        }
        const size_t off = peer_[p].recvd * piece_;
        // A pair_sizes plan knows the length exactly (elsewhere the header's numel decides it).
        const bool fits = plan_.pair_sizes ? m->hdr.len == std::min(piece_, d.len - std::min(d.len, off))
                                           : off + m->hdr.len <= std::max(d.len, off);
        if (!(m->hdr.tag == recv_tag(p) && m->hdr.offset == off && fits)) unexpected(c, p, *m, off);
        if (m->hdr.len) std::memcpy(d.ptr + off, m->data, m->hdr.len);
        c.pop(p);
        ++peer_[p].recvd;
        any = true;
      }
    }
  }
  bool finished = true;
  for (int p = 0; p < size_; ++p) {
    const bool waiting = (peer_[p].bsend && !peer_[p].bsend->done()) || (peer_[p].brecv && !peer_[p].brecv->done());
    finished = finished && !waiting && peer_[p].sent == peer_[p].send_total &&
               (plan_.fold || peer_[p].recvd == peer_[p].recv_total);
    // A peer whose op failed never posts the receive of our bulk send, nor reads the rest of a
    // span that filled its ring; it tells us in an abort message, which check_abort() turns
    // into this op's error. (No other message of this exchange comes from a peer once its
    // offer is read, and a later phase's is left alone.)
    if (waiting || peer_[p].sent < peer_[p].send_total) c.check_abort(p);
  }
  finished = finished && (!plan_.fold || folded_ == fold_total_);
  if (!finished && !any && plan_.watch_all) {
    // Stuck: look at every member's next message of this op, not only this phase's peers',
    // for an abort or a different collective (see ExchangePlan::watch_all).
    for (int p = 0; p < size_; ++p)
      if (p != rank_) c.check_abort(p);
  }
  if (finished) {
    done_ = true;
    for (auto& x : peer_) {
      scratch_pool().put(std::move(x.scratch));
      x.bsend = nullptr;
      x.brecv = nullptr;
    }
  }
  return any;
}

at::Tensor Exchange::bytes_of(uint8_t* p, size_t n) const {
  // The deleter holds the owners: the transport may hold this tensor past the op's end (a
  // transfer abandoned when its op failed), and the memory must outlive it.
  return at::from_blob(p, {(int64_t)n}, [keep = owners_](void*) {},
                       at::TensorOptions().dtype(at::kByte));
}

// Posts the receive of every bulk transfer a peer has offered for this exchange, as soon as
// its offer is here: all of them are then on the wire at once, whatever order the fold (or
// copy) uses them in. An offer is always a peer's only message in an exchange, so only peers
// that sent nothing yet are looked at (a peer done with this exchange may already have sent
// the next phase's offer, with another tag, which is left for that phase).
bool Exchange::post_bulk_recvs(Comm& c) {
  bool any = false;
  for (int p = 0; p < size_; ++p) {
    const Peer& x = peer_[p];
    if (p == rank_ || !x.bulk_from || x.brecv || x.recvd != 0 || x.recv_total == 0) continue;
    const Message* m = c.peek(p);
    if (m != nullptr && (m->hdr.flags & kMsgBulk) && m->hdr.tag == recv_tag(p)) {
      take_offer(c, p, *m);
      any = true;
    }
  }
  return any;
}

namespace {
// A pair_sizes tag: 15 bits of a hash of the sender's span length to the receiver, 16 of the
// length it expects back, under a top bit no phase tag uses. Unequal lengths that hash alike
// (rare) still fail on the side whose receive is short or long, by its length check.
uint32_t hash_bits(uint64_t x, int bits) { return (uint32_t)((x * 0x9E3779B97F4A7C15ull) >> (64 - bits)); }
uint32_t pair_tag(size_t sends, size_t expects) {
  return 0x80000000u | (hash_bits(sends, 15) << 16) | hash_bits(expects, 16);
}
}  // namespace

uint32_t Exchange::send_tag(int p) const {
  return plan_.pair_sizes ? pair_tag(plan_.send[p].len, plan_.recv[p].len) : plan_.tag;
}

uint32_t Exchange::recv_tag(int p) const {
  return plan_.pair_sizes ? pair_tag(plan_.recv[p].len, plan_.send[p].len) : plan_.tag;
}

// The headers of the peer's messages already agree with this op (same collective, dtype,
// size, op and root: the engine checked), so a piece that does not fit this rank's plan means
// the members picked different algorithms, which only settings that must be equal on every rank
// decide; in a pair_sizes plan, that the pair disagrees on its sizes. A typed error, so that
// the op fails on every member (and says why) rather than asserting.
void Exchange::unexpected(const Comm& c, int p, const Message& m, size_t off) const {
  if (plan_.pair_sizes) {
    // The peer's view of the pair, as far as its tag tells.
    const size_t expects = plan_.recv[p].len / es_, sends = plan_.send[p].len / es_;
    const bool their_send = (m.hdr.tag & 0x7fff0000u) != (recv_tag(p) & 0x7fff0000u);
    const bool their_recv = (m.hdr.tag & 0xffffu) != (recv_tag(p) & 0xffffu);
    const std::string them = "group rank " + std::to_string(p);
    std::string how;
    if (their_send) how = them + " sends a different number of elements than the " + std::to_string(expects) +
                          " this rank expects from it";
    if (their_recv) how += (how.empty() ? them : std::string(", and it")) +
                           " expects a different number of elements than the " + std::to_string(sends) +
                           " this rank sends it";
    if (how.empty()) how = them + " sent " + std::to_string(m.hdr.len) + " bytes at offset " +
                           std::to_string(m.hdr.offset) + " where this rank expects " + std::to_string(expects) +
                           " elements in all";
    throw_comm_error(plan_.label + ": this rank (group rank " + std::to_string(c.rank()) + ") and " + them +
                     " disagree on the sizes they exchange: " + how +
                     " (the split sizes, or the list tensors' sizes, must match pairwise)");
  }
  throw_comm_error("fastcomm: group rank " + std::to_string(p) + " sent a piece (phase tag " +
                   std::to_string(m.hdr.tag) + ", offset " + std::to_string(m.hdr.offset) + ", " +
                   std::to_string(m.hdr.len) + " bytes) where group rank " + std::to_string(c.rank()) +
                   " expects phase tag " + std::to_string(plan_.tag) + ", offset " + std::to_string(off) +
                   ": the members run different algorithms for this op; FASTCOMM_HIERARCHICAL and "
                   "FASTCOMM_RSAG_THRESHOLD must be the same on every rank");
}

void Exchange::take_offer(Comm& c, int p, const Message& m) {
  if (!(m.hdr.tag == recv_tag(p) && m.hdr.offset == 0)) unexpected(c, p, m, 0);
  TORCH_INTERNAL_ASSERT(!peer_[p].brecv && peer_[p].recvd == 0, "exchange: second bulk offer from group rank ", p);
  at::Tensor dst;
  if (plan_.fold) {
    peer_[p].scratch = scratch_pool().get(plan_.out.len);
    dst = peer_[p].scratch;
  } else {
    dst = bytes_of(plan_.recv[p].ptr, plan_.recv[p].len);
  }
  peer_[p].brecv = c.recv_bulk(p, m, std::move(dst), peer_[p].bsend.get());
  c.pop(p);
  peer_[p].recvd = peer_[p].recv_total;  // every piece of the span comes in this one transfer
}

void Exchange::fold_from(const uint8_t* src, uint8_t* dst, size_t n) {
  if (!acc_started_) {
    if (dst != src) std::memcpy(dst, src, n * es_);
    acc_started_ = true;
  } else {
    reduce_into(dst, src, n, plan_.dtype, plan_.op);
  }
}

void Exchange::awaiting(std::vector<int>& group_ranks) const {
  if (done_) return;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const Peer& x = peer_[p];
    bool waits = (x.brecv && !x.brecv->done()) || (x.bsend && !x.bsend->done()) || x.sent < x.send_total;
    // A fold takes each piece from the members in order: it stopped at the one not yet heard from.
    if (plan_.fold) waits = waits || (!x.brecv && folded_ < fold_total_ && fold_next_ == p);
    else waits = waits || (!x.brecv && x.recvd < x.recv_total);
    if (waits) group_ranks.push_back(p);
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
    if (peer_[r].brecv) {
      // A failed transfer means its peer was declared dead: the engine fails the op.
      if (!peer_[r].brecv->done()) return false;
      fold_from(peer_[r].scratch.data_ptr<uint8_t>() + off, acc, n);
      continue;
    }
    const Message* m = c.peek(r);
    if (m == nullptr) return false;
    if (m->hdr.flags & kMsgBulk) {  // arrived since this step's post_bulk_recvs
      take_offer(c, r, *m);
      return false;
    }
    if (!(m->hdr.tag == recv_tag(r) && m->hdr.offset == off && m->hdr.len == len)) unexpected(c, r, *m, off);
    fold_from(m->data, acc, n);
    c.pop(r);
    ++peer_[r].recvd;  // (only post_bulk_recvs reads it in a fold: this peer sends pieces)
  }
  if (acc != out) std::memcpy(out, acc, len);
  if (plan_.op == c10d::ReduceOp::AVG) divide_by(out, n, plan_.dtype, plan_.avg_divisor);
  fold_next_ = 0;
  acc_started_ = false;
  ++folded_;
  return true;
}

}  // namespace fastcomm
