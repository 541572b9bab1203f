#include "algorithms/direct.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "algorithms/reduce.h"
#include "common/copy.h"
#include "common/errors.h"

namespace fastcomm {
namespace {

// Message tags of the protocol; distinct from the tags of the fallback's exchanges, so members
// that disagree on whether to try it (FASTCOMM_SHM_DIRECT_BYTES) fail on a mismatch.
constexpr uint32_t kTagWhere = 0x400;   // payload: SharedSpan, or nothing (not in a buffer)
constexpr uint32_t kTagMapped = 0x401;  // payload: 1 byte, whether all other spans mapped here
constexpr uint32_t kTagFolded = 0x402;  // a chunk of this member's slice is reduced (offset: which)
constexpr uint32_t kTagCopied = 0x403;  // this member no longer reads the others' memory

// Members announce their folded slices in chunks of this size, and fold piece by piece so the
// accumulator stays in cache.
constexpr size_t kChunkBytes = 256 * 1024;
constexpr size_t kPieceBytes = 64 * 1024;

class DirectAllReduce final : public Op {
 public:
  DirectAllReduce(OpDesc d, at::Tensor t, int rank, int size, std::unique_ptr<Op> fallback)
      : Op(d), t_(std::move(t)), rank_(rank), size_(size), fallback_(std::move(fallback)) {}

  bool step(Comm& c) override {
    bool any = false;
    for (;;) {
      switch (state_) {
        case kStart: start(c); any = true; break;
        case kWhere:
          if (!post(c, kTagWhere, have_span_ ? &span_ : nullptr, have_span_ ? sizeof(span_) : 0)) return any;
          if (!collect(c, kTagWhere)) return any;
          any = true;
          decide_where(c);
          break;
        case kMapped: {
          const uint8_t ok = mapped_ ? 1 : 0;
          if (!post(c, kTagMapped, &ok, 1)) return any;
          if (!collect(c, kTagMapped)) return any;
          any = true;
          state_ = all_mapped_ && mapped_ ? kRun : kFallback;
          if (state_ == kRun) begin_run();
          break;
        }
        case kRun:
          if (!run(c, any)) return any;
          state_ = kCopied;
          sent_ = 0;
          break;
        case kCopied:
          if (!post(c, kTagCopied, nullptr, 0)) return any;
          if (!collect(c, kTagCopied)) return any;
          state_ = kDone;
          return true;
        case kFallback: return fallback_->step(c) || any;
        case kDone: return any;
      }
    }
  }
  bool done() const override { return state_ == kDone || (state_ == kFallback && fallback_->done()); }
  void append_outputs(std::vector<at::Tensor>& out) const override { out.push_back(t_); }
  bool restartable() const override { return fallback_->restartable(); }
  void restart() override {
    state_ = kStart;
    fallback_->restart();
  }
  void awaiting(std::vector<int>& group_ranks) const override {
    if (state_ == kFallback) return fallback_->awaiting(group_ranks);
    if (state_ == kRun) {
      // An announcement that could not go yet, else the first member whose chunks are missing.
      if (notified_ < folded_ && sent_ < size_) {
        group_ranks.push_back(sent_);
        return;
      }
      for (int q = 0; q < size_; ++q)
        if (q != rank_ && copied_[q] < chunks(q)) {
          group_ranks.push_back(q);
          return;
        }
      return;
    }
    if (state_ != kWhere && state_ != kMapped && state_ != kCopied) return;
    // post() stopped at a member whose ring is full, else collect() at one not yet heard from.
    if (sent_ < size_) group_ranks.push_back(sent_);
    else if (got_ < size_) group_ranks.push_back(got_);
  }

 private:
  enum State { kStart, kWhere, kMapped, kRun, kCopied, kFallback, kDone };

  uint8_t* base() const { return static_cast<uint8_t*>(t_.data_ptr()); }
  size_t nbytes() const { return (size_t)t_.numel() * t_.element_size(); }
  std::pair<size_t, size_t> slice(int r) const {  // byte range of member r's slice
    const size_t n = (size_t)t_.numel(), es = t_.element_size();
    return {n * (size_t)r / (size_t)size_ * es, n * (size_t)(r + 1) / (size_t)size_ * es};
  }

  void start(Comm& c) {
    bool all_share = true;
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && !c.shares_memory(q)) all_share = false;
    // A member whose transport to some other member shares no memory is on another host, and
    // then so does every member's to some member: all of them skip the protocol alike.
    if (!all_share) {
      state_ = kFallback;
      return;
    }
    have_span_ = c.export_span(base(), nbytes(), &span_);
    peer_.assign(size_, nullptr);
    spans_.assign(size_, SharedSpan{});
    has_.assign(size_, 0);
    state_ = kWhere;
    sent_ = 0;
    got_ = 0;
  }

  // Sends this state's message to every other member once; false while some could not go yet.
  bool post(Comm& c, uint32_t tag, const void* data, size_t len, uint64_t offset = 0) {
    for (; sent_ < size_; ++sent_) {
      if (sent_ == rank_) continue;
      if (!c.send(sent_, offset, tag, data, (uint32_t)len)) return false;
    }
    return true;
  }

  // Takes this state's message from every member; false while some has not arrived.
  bool collect(Comm& c, uint32_t tag) {
    for (; got_ < size_; ++got_) {
      if (got_ == rank_) continue;
      const Message* m = c.peek(got_);
      if (m == nullptr) return false;
      if (m->hdr.tag != tag) unexpected(c, got_, *m, tag);
      if (tag == kTagWhere && m->hdr.len == sizeof(SharedSpan)) {
        std::memcpy(&spans_[got_], m->data, sizeof(SharedSpan));
        has_[got_] = 1;
      } else if (tag == kTagMapped) {
        if (m->hdr.len != 1) unexpected(c, got_, *m, tag);
        if (m->data[0] == 0) all_mapped_ = false;
      } else if (m->hdr.len != 0) {
        unexpected(c, got_, *m, tag);
      }
      c.pop(got_);
    }
    got_ = 0;
    return true;
  }

  void decide_where(Comm& c) {
    bool all = have_span_;
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && !has_[q]) all = false;
    // Every member saw the same set of descriptions, so all of them fall back together.
    if (!all) {
      state_ = kFallback;
      return;
    }
    mapped_ = true;
    all_mapped_ = true;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      if (spans_[q].bytes != nbytes())
        throw_comm_error("fastcomm: group rank " + std::to_string(c.rank()) + ": group rank " + std::to_string(q) +
                         " described " + std::to_string(spans_[q].bytes) + " bytes for an all_reduce of " +
                         std::to_string(nbytes()));
      peer_[q] = c.import_span(q, spans_[q]);
      if (peer_[q] == nullptr) mapped_ = false;
    }
    state_ = kMapped;
    sent_ = 0;
  }

  size_t chunks(int r) const {
    const auto [b, e] = slice(r);
    return (e - b + kChunkBytes - 1) / kChunkBytes;
  }
  std::pair<size_t, size_t> chunk_of(int r, size_t k) const {  // byte range of chunk k of r's slice
    const auto [b, e] = slice(r);
    return {b + k * kChunkBytes, std::min(e, b + (k + 1) * kChunkBytes)};
  }

  void begin_run() {
    folded_ = notified_ = 0;
    sent_ = 0;
    copied_.assign(size_, 0);
  }

  // Folds this member's slice chunk by chunk, telling the others after each, and copies each
  // chunk of theirs as soon as they tell: the chunk is then still in a cache. A member
  // overwrites its copy of another's chunk only after that one has folded it, so never while
  // it is being read. True once every chunk is folded, told and copied.
  bool run(Comm& c, bool& any) {
    const size_t mine = chunks(rank_);
    for (;;) {
      bool moved = false;
      if (notified_ < folded_) {
        if (!post(c, kTagFolded, nullptr, 0, notified_)) break;
        c.flush();
        ++notified_;
        sent_ = 0;
        moved = true;
      } else if (folded_ < mine) {
        const auto [b, e] = chunk_of(rank_, folded_);
        fold(b, e);
        ++folded_;
        moved = true;
      }
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        while (copied_[q] < chunks(q)) {
          const Message* m = c.peek(q);
          if (m == nullptr) break;
          if (m->hdr.tag != kTagFolded || m->hdr.len != 0 || m->hdr.offset != copied_[q])
            unexpected(c, q, *m, kTagFolded);
          const auto [b, e] = chunk_of(q, copied_[q]);
          // Past the cache: the member that folds this chunk next time then reads it from
          // memory, not from this core's cache (5-10x slower where the two cores share no
          // cache; docs/benchmarks.md).
          stream_copy(base() + b, peer_[q] + b, e - b);
          c.pop(q);
          ++copied_[q];
          moved = true;
        }
      }
      any |= moved;
      if (!moved) break;
    }
    if (notified_ < mine) return false;
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && copied_[q] < chunks(q)) return false;
    return true;
  }

  // Bytes [b, e) of this member's slice, reduced from every member's memory in group-rank
  // order (the order every other algorithm folds in, so the bits are the same as theirs).
  void fold(size_t b, size_t e) {
    const size_t es = t_.element_size();
    const c10::ScalarType dtype = t_.scalar_type();
    const auto op = desc_.redop;
    uint8_t* own = base();
    // Member 1 may start from its own data too: a1 (op) a0 is a0 (op) a1, bit for bit, for
    // every op and dtype here.
    const bool into_own = rank_ <= 1 || order_independent(dtype, op);
    if (!into_own) tmp_.resize(kPieceBytes);
    const size_t piece = kPieceBytes / es * es;
    for (size_t off = b; off < e; off += piece) {
      const size_t len = std::min(piece, e - off), n = len / es;
      uint8_t* out = own + off;
      auto src = [&](int r) -> const uint8_t* { return r == rank_ ? out : peer_[r] + off; };
      if (into_own) {
        for (int r = 0; r < size_; ++r)
          if (r != rank_) reduce_into(out, src(r), n, dtype, op);
      } else {
        uint8_t* acc = tmp_.data();
        reduce_to(acc, src(0), src(1), n, dtype, op);
        for (int r = 2; r < size_; ++r) reduce_into(acc, src(r), n, dtype, op);
        std::memcpy(out, acc, len);
      }
      if (op == c10d::ReduceOp::AVG) divide_by(out, n, dtype, size_);
    }
  }

  [[noreturn]] void unexpected(const Comm& c, int from, const Message& m, uint32_t tag) const {
    throw_comm_error("fastcomm: group rank " + std::to_string(c.rank()) + " expected step " + std::to_string(tag) +
                     " of the in-place all_reduce from group rank " + std::to_string(from) + ", got tag " +
                     std::to_string(m.hdr.tag) + " with " + std::to_string(m.hdr.len) +
                     " bytes (FASTCOMM_SHM_DIRECT_BYTES must be equal on all ranks)");
  }

  at::Tensor t_;
  int rank_, size_;
  std::unique_ptr<Op> fallback_;
  State state_ = kStart;
  int sent_ = 0, got_ = 0;
  size_t folded_ = 0, notified_ = 0;  // chunks of this member's slice folded, announced
  std::vector<size_t> copied_;        // by member: chunks of its slice copied here
  bool have_span_ = false, mapped_ = false, all_mapped_ = false;
  SharedSpan span_;
  std::vector<SharedSpan> spans_;
  std::vector<char> has_;
  std::vector<const uint8_t*> peer_;
  std::vector<uint8_t> tmp_;
};

}  // namespace

std::unique_ptr<Op> make_direct_all_reduce(OpDesc d, const at::Tensor& t, int rank, int size,
                                           std::unique_ptr<Op> fallback) {
  return std::make_unique<DirectAllReduce>(d, t, rank, size, std::move(fallback));
}

}  // namespace fastcomm
