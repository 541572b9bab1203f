#pragma once
// Exchange: the building block of every small-group algorithm. Each member sends one byte span
// to each other member and receives one from each, in pieces of at most the transport's
// payload. Received bytes are copied to their destination, or folded into one output in
// group-rank order (this rank's own span at its place), so all members round identically. An
// empty span still sends one message: its header is how mismatched collectives are caught.
// Large spans may travel as bulk transfers where the transport has them (docs/design.md).
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "algorithms/comm.h"

namespace fastcomm {

// Arrays indexed by group rank. Inline up to 4 members (pairs, ring neighbours), so an op in
// such a group allocates nothing for them, and an all_reduce's op stays small enough for
// malloc's per-thread cache: a blocking small op's cost is mostly such bookkeeping.
template <typename T>
using PerMember = c10::SmallVector<T, 4>;

struct Span {
  uint8_t* ptr = nullptr;
  size_t len = 0;
  bool active = false;  // false: no message at all in this direction
  static Span of(void* p, size_t n) { return Span{static_cast<uint8_t*>(p), n, true}; }
};

struct ExchangePlan {
  PerMember<Span> send;  // by group rank
  PerMember<Span> recv;  // by group rank; copy mode destinations
  bool fold = false;       // fold mode: every active recv span is reduced into `out`
  Span out;                // fold output
  const uint8_t* own = nullptr;  // this rank's contribution to the fold (may alias out)
  bool send_aliases_out = false;  // the spans we send are `out` itself (in-place all_reduce)
  c10::ScalarType dtype = c10::ScalarType::Byte;
  c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM;
  int avg_divisor = 1;  // AVG: divide each folded piece by this
  uint32_t tag = 0;     // distinguishes the exchanges of one multi-phase op
  // Bulk transfers allowed. Not for point-to-point: a bulk send completes only once the
  // receiver has posted its receive, and a send must be able to complete on its own (two
  // ranks that both send, then both receive, must not deadlock), as it does through frames.
  bool bulk = true;
  // While the exchange cannot move, also check the members it neither sends to nor receives
  // from in this phase for an abort or a mismatched collective. A phase of a hierarchical op
  // talks to a few members only; a member that issued a different collective may have sent
  // its only message to someone who never reads it, and without this every member would wait
  // for its timeout instead of failing on the mismatch.
  bool watch_all = false;
  // Copy mode where every pair exchanges both ways (all_to_all, whose header holds no per-pair
  // sizes): each message's tag carries its sender's view of the pair's two span lengths
  // instead of `tag`, so two members that disagree on either fail on both sides.
  bool pair_sizes = false;
  std::string label;  // pair_sizes: "fastcomm.<api>: rank R, group [..]", to name in that error
};

class Exchange {
 public:
  // `owners`: tensors whose memory the plan's spans point into; bulk transfers keep them alive
  // for as long as the transport may touch that memory.
  void start(ExchangePlan plan, int rank, int size, size_t elem_size, Comm& c,
             c10::ArrayRef<at::Tensor> owners, c10::ArrayRef<at::Tensor> more_owners = {});
  bool step(Comm& c);
  bool done() const { return done_; }
  void awaiting(std::vector<int>& group_ranks) const;  // as Op::awaiting

 private:
  size_t pieces(size_t len) const { return len == 0 ? 1 : (len + piece_ - 1) / piece_; }
  bool fold_piece(Comm& c);
  void fold_from(const uint8_t* src, uint8_t* dst, size_t n);
  bool post_bulk_recvs(Comm& c);
  void take_offer(Comm& c, int p, const Message& m);
  [[noreturn]] void unexpected(const Comm& c, int p, const Message& m, size_t off) const;
  // The tag of this exchange's messages to / from group rank p.
  uint32_t send_tag(int p) const;
  uint32_t recv_tag(int p) const;
  at::Tensor bytes_of(uint8_t* p, size_t n) const;

  ExchangePlan plan_;
  int rank_ = 0, size_ = 1;
  size_t es_ = 1, piece_ = 1;
  // Per group rank, in one array (one reset per phase): pieces sent and received, of how many.
  struct Peer {
    size_t sent = 0, send_total = 0, recvd = 0, recv_total = 0;
    bool bulk_send = false;  // this rank's span to it travels as a bulk transfer
    bool bulk_from = false;  // its transport has bulk transfers: it may send an offer
    // The bulk transfers (null: that direction uses ordinary messages), and the scratch a bulk
    // fold receives into.
    std::shared_ptr<Bulk> bsend, brecv;
    at::Tensor scratch;
  };
  PerMember<Peer> peer_;
  size_t folded_ = 0, fold_total_ = 0;
  int fold_next_ = 0;
  bool inplace_ = false, direct_ = false, acc_started_ = false, done_ = false;
  std::vector<uint8_t> tmp_;
  // The storages the spans point into (not the tensors: a tensor can be given new storage,
  // say by set_(), while a transfer still uses the old one).
  c10::SmallVector<c10::Storage, 2> owners_;
};

}  // namespace fastcomm
