#pragma once
// What an algorithm sees: one op's view of its group. Ranks here are group ranks; the engine
// maps them to peers, fills in the op's identity (group, seq, description) on every message
// it sends, and on receive hands over only messages of this op, checking that the sender
// issued the same collective.
#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <string>

#include "algorithms/op_kind.h"
#include "transport/transport.h"

namespace fastcomm {

// The part of an op that every member must agree on; travels in every message header.
struct OpDesc {
  OpKind kind = OpKind::kAllReduce;
  c10::ScalarType dtype = c10::ScalarType::Float;
  c10d::ReduceOp::RedOpType redop = c10d::ReduceOp::SUM;
  uint64_t numel = 0;
  int32_t root = -1;
};

const char* redop_name(uint8_t op);
std::string describe(const OpDesc& d);

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;  // this process's rank in the group
  virtual int size() const = 0;
  virtual size_t max_payload() const = 0;
  // Sends `len` bytes to group rank `to`, labelled with `offset` and `tag`; false if there is
  // no room now (retry on a later step).
  virtual bool send(int to, uint64_t offset, uint32_t tag, const void* data, uint32_t len) = 0;
  // Sends become visible to peers when the engine's progress pass ends (so a batch costs one
  // write and one wake-up per peer); an op streaming large data calls flush() to publish its
  // pieces before it spends time reducing.
  virtual void flush() = 0;
  // The next message of this op from group rank `from`, or nullptr. Throws CommError when the
  // sender issued a different collective or aborted this op.
  virtual const Message* peek(int from) = 0;
  virtual void pop(int from) = 0;
  // Throws CommError if this op's next message from `from` is already here and is an abort or
  // a mismatch; reads past nothing (unlike peek, which may set other ops' messages aside).
  virtual void check_abort(int from) = 0;

  // Bulk transfers (transport/transport.h): a span of at least bulk_min(to) bytes may travel
  // as one message straight from and into the op's memory instead of in pieces copied
  // through the transport's buffers. send_bulk starts the transfer and appends the offer that
  // tells `to` about it (null: no room for the offer now; retry). recv_bulk posts the receive
  // of the transfer that `offer`, just peeked from `from`, announces (the caller pops it);
  // `with` is this op's bulk send to `from`, if any (the transport may wait on both at once).
  virtual size_t bulk_min(int to) = 0;
  virtual std::shared_ptr<Bulk> send_bulk(int to, uint32_t tag, at::Tensor bytes) = 0;
  virtual std::shared_ptr<Bulk> recv_bulk(int from, const Message& offer, at::Tensor bytes,
                                          Bulk* with) = 0;

  // Reading members' memory in place (Transport::import_span): whether this rank could map
  // what `member` exports, this rank's description of [p, p + n) if it lies in a shared
  // buffer (false otherwise), and the address here of a span `member` described (null when
  // it cannot be mapped).
  virtual bool shares_memory(int /*member*/) { return false; }
  virtual bool export_span(const void* /*p*/, size_t /*n*/, SharedSpan* /*out*/) { return false; }
  virtual const uint8_t* import_span(int /*member*/, const SharedSpan& /*span*/) { return nullptr; }
};

}  // namespace fastcomm
