#pragma once
// The interface every transport implements (shared memory now; Gloo and NCCL later repeat the
// same file names under transport/<name>/). A transport moves ordered, self-describing
// messages between this process and one peer at a time; it knows nothing of groups or
// collectives. Algorithms never see a transport directly: they see the group-scoped view in
// algorithms/comm.h, which the engine implements on top of this interface.
#include <cstddef>
#include <cstdint>
#include <string>

namespace fastcomm {

// Every message carries the full description of the op it belongs to, so a receiver can both
// route it (group, seq) and check that the sender issued the same collective (kind, dtype,
// numel, reduce op, root). 48 bytes; transports may pad it.
struct Header {
  uint64_t group = 0;   // group id, equal on all members
  uint64_t seq = 0;     // index of the op within its group, equal on all members
  uint64_t numel = 0;   // elements of the op's tensor (as the sender sees it)
  uint64_t offset = 0;  // byte offset of this payload in the algorithm's logical stream
  uint32_t len = 0;     // payload bytes following the header
  uint32_t tag = 0;     // algorithm-defined (phase, step)
  int32_t root = -1;    // root group rank for rooted collectives, else -1
  uint8_t kind = 0;     // OpKind
  uint8_t dtype = 0;    // c10::ScalarType
  uint8_t redop = 0;    // c10d::ReduceOp::RedOpType
  uint8_t flags = 0;    // MessageFlags
};
static_assert(sizeof(Header) == 48, "wire header layout");

enum MessageFlags : uint8_t {
  kMsgAbort = 1,  // the sender failed this op; payload is an explanation (UTF-8)
};

// A received message. `data` stays valid until the transport's pop() for that peer.
struct Message {
  Header hdr;
  const uint8_t* data = nullptr;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // Largest payload a single message may carry; equal on every rank of the job.
  virtual size_t max_payload() const = 0;
  // Appends one message for `peer` (global rank) if there is room now; never blocks.
  // On false the transport arranges to ring this process's doorbell once room appears.
  // Appended messages become visible to the peer at the next flush().
  virtual bool try_send(int peer, const Header& hdr, const void* payload) = 0;
  // Publishes everything appended since the last flush and wakes the receivers: one publish
  // and one wake-up per peer, however many messages (of however many groups) were appended.
  virtual void flush() = 0;
  // The oldest unconsumed message from `peer`, or nullptr; never blocks.
  virtual const Message* peek(int peer) = 0;
  // Consumes the message last returned by peek(peer).
  virtual void pop(int peer) = 0;
  // False once the transport knows the peer process is gone.
  virtual bool peer_alive(int peer) = 0;
};

}  // namespace fastcomm
