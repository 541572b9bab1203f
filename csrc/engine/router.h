#pragma once
// Routes incoming messages to the op they belong to. A peer's messages come in one stream for
// all groups; an op reads only those of its own (group, seq): the ones in front of it that
// belong to ops not yet stepped here are set aside (the stash) and replayed in arrival order,
// and those of ops that already finished here are dropped. Under the engine lock.
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

#include "engine/group.h"
#include "transport/transport_set.h"

namespace fastcomm {

class MessageRouter {
 public:
  MessageRouter(TransportSet& transports, GroupRegistry& groups) : tr_(transports), groups_(groups) {}

  // The next message of op `seq` of group `g` from `peer`, or null. `scan`: read past (and
  // stash) other ops' messages to find it; without it only the stash and the head of the
  // peer's stream are looked at.
  const Message* peek(const GroupState& g, uint64_t seq, int peer, bool scan = true);
  // Consumes what peek() returned. `discard`: it is dropped unused (an offer in it is drained).
  void pop(const GroupState& g, uint64_t seq, int peer, bool discard = false);
  // Drops what peers sent for op `seq` of `g` that it never read (the op failed).
  void purge(const GroupState& g, uint64_t seq);
  // Drops messages of finished ops at the head of `g`'s members' streams; true if any.
  bool drop_stale(const GroupState& g, int self);
  size_t stashed() const { return stash_msgs_; }
  // While set (a progress pass), a message at the head of a stream that belongs to the front
  // op of another busy group is left there instead of stashed (copied): that group's op takes
  // it in place on the pass's rerun. took_deferred() says whether any was left (and clears it).
  void set_defer(bool on) { defer_ = on; }
  bool took_deferred() {
    const bool d = deferred_;
    deferred_ = false;
    return d;
  }
  void clear();

 private:
  struct Key {
    uint64_t group, seq;
    int peer;
    bool operator==(const Key& o) const { return group == o.group && seq == o.seq && peer == o.peer; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<uint64_t>()(k.group * 0x9e3779b97f4a7c15ULL ^ k.seq * 31 ^ (uint64_t)k.peer);
    }
  };
  struct Stashed {
    Message msg;
    std::vector<uint8_t> bytes;
  };
  bool stale(const Message& m) const {
    const GroupState* g = groups_.find(m.hdr.group);
    return g != nullptr && m.hdr.seq < g->head_seq;
  }
  void discard(Transport* tr, int peer, const Message& m);

  TransportSet& tr_;
  GroupRegistry& groups_;
  std::unordered_map<Key, std::deque<Stashed>, KeyHash> stash_;
  size_t stash_msgs_ = 0;
  bool defer_ = false, deferred_ = false;
};

}  // namespace fastcomm
