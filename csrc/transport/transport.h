#pragma once
// The interface every transport implements (each under transport/<name>/ with the same file
// names). A transport moves ordered, self-describing messages between this process and one
// peer at a time; it knows nothing of groups or collectives. Algorithms never see one: they see
// the group-scoped view in algorithms/comm.h, which the engine builds on this interface.
#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
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
  kMsgBulk = 2,   // an offer: the span travels as bulk transfer `BulkOffer::slot`
};

// Payload of a kMsgBulk message.
struct BulkOffer {
  uint64_t slot = 0;   // names the transfer between this sender and receiver
  uint64_t bytes = 0;  // its length
};

// A bulk transfer: one span moved as a single transport message straight from the sender's
// memory into the receiver's, where a transport can do that (Gloo can; the rings cannot, and
// need none). The sender starts it and tells the receiver its slot in an ordinary message
// (an offer); the receiver, once its op reads the offer, posts the matching receive. Either
// side learns completion from done(); the transport's threads set it and ring the doorbell.
// The handle keeps the memory it reads or writes alive until the transfer is over.
struct Bulk {
  virtual ~Bulk() = default;  // a transport's own record of the transfer derives from it
  uint64_t slot = 0;
  std::atomic<int> state{0};  // 0: in flight, 1: done, 2: failed (the peer is declared dead)
  bool done() const { return state.load(std::memory_order_acquire) == 1; }
  bool failed() const { return state.load(std::memory_order_acquire) == 2; }
};

// A span of a tensor in a process's shared buffer (transport/shm/buffers.h), as its owner
// describes it to a peer on the same host, which maps the buffer and reads the span in place.
struct SharedSpan {
  uint64_t buffer = 0;  // the owner's id of the buffer, never reused
  uint64_t offset = 0;  // of the span in the buffer
  uint64_t bytes = 0;   // of the span
  uint64_t size = 0;    // of the whole buffer
  int32_t fd = -1;      // the owner's descriptor of the buffer, valid while its op runs
  uint32_t pad = 0;
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
  // False once the transport knows the peer process is gone (or its engine shut down: kShutDown).
  virtual bool peer_alive(int peer) = 0;
  // Why a peer is reported gone, when the transport knows more than that ("" otherwise).
  virtual std::string death_reason(int /*peer*/) { return ""; }
  // The death_reason of a same-host peer whose engine shut down while its process lives on.
  static constexpr const char* kShutDown = "shut fastcomm down";
  // What an op waiting on `peer` may be waiting for besides the peer itself (a connection
  // still being made), for a timeout's message; "" if nothing.
  virtual std::string pending_reason(int /*peer*/) { return ""; }
  // Starts whatever it takes to hear from `peer` (and so to learn of its death) before any op
  // reads from it. Idempotent.
  virtual void connect(int /*peer*/) {}
  // Whether anything can have come from `peer` yet (false while no connection to it is up):
  // looking at a peer only in case it sent something (an abort, a stale message) need not,
  // and should not, make a connection, which peek() does.
  virtual bool linked(int /*peer*/) { return true; }
  // A dead peer's resources may go: no op reads from it any more.
  virtual void release_peer(int /*peer*/) {}
  // Stops the transport's threads; no call but the destructor follows.
  virtual void stop() {}
  // For transports whose own threads deliver messages: what such a thread runs once one is in
  // (the engine's progress pass; false when another thread holds the engine). Set once, before
  // any message moves.
  virtual void set_delivery_hook(std::function<bool()> /*hook*/) {}
  // For transports with a closing handshake: whether the engine still runs an op of a group
  // with `peer` (1), does not (0), or cannot say now (-1: another thread holds it). A peer
  // that leaves is told it may close only once no such op runs: its leaving would fail them.
  virtual void set_close_gate(std::function<int(int)> /*busy_with*/) {}
  // Diagnostic counters, by name (what tests check a transport's traffic by).
  virtual std::map<std::string, uint64_t> counters() { return {}; }

  // Bulk transfers (see Bulk). Spans of at least bulk_min(peer) bytes may go this way;
  // SIZE_MAX (the default) means never. `more_ops`: the engine has other ops in flight
  // besides the one asking, so the link to the peer is likely busy. `bytes` is a byte tensor
  // over the span whose deleter keeps the span's owner alive.
  virtual size_t bulk_min(int /*peer*/, bool /*more_ops*/) { return SIZE_MAX; }
  virtual std::shared_ptr<Bulk> send_bulk(int /*peer*/, at::Tensor /*bytes*/) { return nullptr; }
  // Receives the transfer `offer` (a kMsgBulk message from `peer`) announces into scratch
  // and drops it: for offers no op will take, whose senders would otherwise wait for good.
  virtual void drain_bulk(int /*peer*/, const Message& /*offer*/) {}
  // `with`: a transfer of the same op with the same peer that this one may be waited on
  // together with (the op needs both before it moves on), or null.
  virtual std::shared_ptr<Bulk> recv_bulk(int /*peer*/, uint64_t /*slot*/, at::Tensor /*bytes*/,
                                          Bulk* /*with*/) {
    return nullptr;
  }

  // Reading peers' memory in place. shares_memory: this transport could map what `peer`
  // exports. import_span maps a span that `peer` exported (cached by buffer) and returns its
  // address here, or null when it cannot; the mapping stays valid while the transport lives.
  virtual bool shares_memory(int /*peer*/) { return false; }
  virtual const uint8_t* import_span(int /*peer*/, const SharedSpan& /*span*/) { return nullptr; }
};

}  // namespace fastcomm
