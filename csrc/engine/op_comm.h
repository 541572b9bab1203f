#pragma once
// The Comm view (algorithms/comm.h) of one op: group ranks mapped to peers, the op's identity
// stamped on every message it sends, and on receive only its own messages, checked against
// what this rank issued. Made by the progress pass for each step, under the engine lock.
#include "algorithms/comm.h"
#include "engine/group.h"
#include "engine/router.h"
#include "transport/transport_set.h"

namespace fastcomm {

class OpComm final : public Comm {
 public:
  // `more_ops`: other ops are in flight beside this one (the transports' hint that a link will
  // be busy, Transport::bulk_min).
  OpComm(MessageRouter& router, TransportSet& tr, bool more_ops, GroupState& g, Pending& p)
      : router_(router), tr_(tr), more_ops_(more_ops), g_(g), p_(p) {}

  int rank() const override { return g_.rank; }
  int size() const override { return (int)g_.ranks.size(); }
  size_t max_payload() const override { return tr_.max_payload(); }
  bool send(int to, uint64_t offset, uint32_t tag, const void* data, uint32_t len) override {
    const int peer = g_.ranks[to];
    return tr_.of(peer)->try_send(peer, header(offset, tag, len), data);
  }
  void flush() override { tr_.flush(); }
  const Message* peek(int from) override {
    const int peer = g_.ranks[from];
    return checked(peer, router_.peek(g_, p_.seq, peer));
  }
  void pop(int from) override { router_.pop(g_, p_.seq, g_.ranks[from]); }
  void check_abort(int from) override {
    const int peer = g_.ranks[from];
    if (tr_.of(peer)->linked(peer)) checked(peer, router_.peek(g_, p_.seq, peer, /*scan=*/false));
  }
  size_t bulk_min(int to) override {
    const int peer = g_.ranks[to];
    return tr_.of(peer)->bulk_min(peer, more_ops_);
  }
  std::shared_ptr<Bulk> send_bulk(int to, uint32_t tag, at::Tensor bytes) override;
  std::shared_ptr<Bulk> recv_bulk(int from, const Message& m, at::Tensor bytes, Bulk* with) override;
  bool shares_memory(int member) override {
    const int peer = g_.ranks[member];
    return tr_.of(peer)->shares_memory(peer);
  }
  bool export_span(const void* p, size_t n, SharedSpan* out) override;
  const uint8_t* import_span(int member, const SharedSpan& span) override {
    const int peer = g_.ranks[member];
    return tr_.of(peer)->import_span(peer, span);
  }

  // The header of every message of this op.
  static Header header_of(const GroupState& g, const Pending& p, uint64_t offset, uint32_t tag, uint32_t len);

 private:
  Header header(uint64_t offset, uint32_t tag, uint32_t len) const { return header_of(g_, p_, offset, tag, len); }
  // `m` if it agrees with this op; otherwise the op's error (an abort or a mismatch), the
  // message dropped first.
  const Message* checked(int peer, const Message* m) {
    if (m == nullptr) return nullptr;
    const OpDesc& d = p_.op->desc();
    const Header& h = m->hdr;
    if (!(h.flags & kMsgAbort) && h.kind == (uint8_t)d.kind && h.dtype == (uint8_t)d.dtype &&
        h.numel == d.numel && h.redop == (uint8_t)d.redop && h.root == d.root)
      return m;
    reject(peer, *m);
  }
  [[noreturn]] void reject(int peer, const Message& m);

  MessageRouter& router_;
  TransportSet& tr_;
  const bool more_ops_;
  GroupState& g_;
  Pending& p_;
};

}  // namespace fastcomm
