#include "engine/op_comm.h"

#include <cstring>

#include "common/errors.h"
#include "transport/shm/buffers.h"

namespace fastcomm {

Header OpComm::header_of(const GroupState& g, const Pending& p, uint64_t offset, uint32_t tag, uint32_t len) {
  const OpDesc& d = p.op->desc();
  Header h;
  h.group = g.id;
  h.seq = p.seq;
  h.numel = d.numel;
  h.offset = offset;
  h.len = len;
  h.tag = tag;
  h.root = d.root;
  h.kind = (uint8_t)d.kind;
  h.dtype = (uint8_t)d.dtype;
  h.redop = (uint8_t)d.redop;
  return h;
}

std::shared_ptr<Bulk> OpComm::send_bulk(int to, uint32_t tag, at::Tensor bytes) {
  const int peer = g_.ranks[to];
  Transport* tr = tr_.of(peer);
  BulkOffer offer;
  offer.bytes = (uint64_t)bytes.numel();
  auto b = tr->send_bulk(peer, std::move(bytes));
  TORCH_INTERNAL_ASSERT(b, "send_bulk on a transport without bulk transfers");
  offer.slot = b->slot;
  Header h = header(0, tag, sizeof(offer));
  h.flags = kMsgBulk;
  // Transports with bulk transfers never run out of room for a message.
  TORCH_INTERNAL_ASSERT(tr->try_send(peer, h, &offer), "no room for a bulk offer");
  return b;
}

std::shared_ptr<Bulk> OpComm::recv_bulk(int from, const Message& m, at::Tensor bytes, Bulk* with) {
  const int peer = g_.ranks[from];
  BulkOffer offer;
  if (m.hdr.len != sizeof(offer)) throw_comm_error("fastcomm: malformed bulk offer from rank " + std::to_string(peer));
  std::memcpy(&offer, m.data, sizeof(offer));
  if (offer.bytes != (uint64_t)bytes.numel())
    throw_comm_error("fastcomm: rank " + std::to_string(peer) + " offered " + std::to_string(offer.bytes) +
                     " bytes for op #" + std::to_string(p_.seq) + " of group " + g_.label + ", this rank expects " +
                     std::to_string(bytes.numel()));
  auto b = tr_.of(peer)->recv_bulk(peer, offer.slot, std::move(bytes), with);
  TORCH_INTERNAL_ASSERT(b, "bulk offer from a peer whose transport has no bulk transfers");
  return b;
}

bool OpComm::export_span(const void* p, size_t n, SharedSpan* out) { return find_shared_span(p, n, out); }

void OpComm::reject(int peer, const Message& m) {
  const OpDesc& d = p_.op->desc();
  const Header& h = m.hdr;
  std::string err;
  if (h.flags & kMsgAbort) {
    err = "op #" + std::to_string(p_.seq) + " (" + describe(d) + ") failed on rank " + std::to_string(peer) + ": " +
          std::string(reinterpret_cast<const char*>(m.data), h.len);
  } else {
    OpDesc theirs{(OpKind)h.kind, (c10::ScalarType)h.dtype, (c10d::ReduceOp::RedOpType)h.redop, h.numel, h.root};
    err = "mismatched collectives at op #" + std::to_string(p_.seq) + ": this rank issued " + describe(d) +
          ", rank " + std::to_string(peer) + " issued " + describe(theirs);
  }
  router_.pop(g_, p_.seq, peer, /*discard=*/true);
  throw_comm_error("fastcomm: rank " + std::to_string(g_.ranks[g_.rank]) + ", group " + g_.label + ": " + err);
}

}  // namespace fastcomm
