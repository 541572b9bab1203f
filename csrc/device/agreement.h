#pragma once
// The pair agreement of one side of a channel, as a pure state machine: items (parts of ops
// with the peer) and frames in; frames out, items to launch in the agreed order, items failed.
// No runtime, no host link, no clock: tests/cpp/test_agreement.cpp drives two of them through
// scripted interleavings.
//
// - The leader (the pair's lower rank) proposes each item once it is ready here; the follower
//   commits the proposals it has a matching ready item for, in the order its items become ready,
//   and both launch in commit order (the follower when it commits, the leader when the commit
//   arrives: one order, since the control stream of a pair is ordered). A proposal whose
//   signature differs from the follower's item fails both (kMismatch).
// - Epochs. A side whose op times out resets the channel: every item it holds fails, its epoch
//   goes up, and a kReset frame tells the peer the highest sequence number it cancelled in each
//   group (its floors). The peer fails what it holds too, takes the same epoch and answers with
//   its own floors (kResetAck). Each side then fails, now or when it is issued, every item at or
//   under either side's floor, so an op cancelled on one side is cancelled on both, and ops
//   issued later run in the new epoch, on a new communicator. Frames of an older epoch are
//   stale and dropped; a proposal under a floor is answered kCancel.
// - Release. The leader of an idle pair may end the epoch with kRelease: nothing fails, both
//   drop the communicator, the next proposal brings a new one. Only the leader releases: it
//   knows no proposal of its is in flight, so none can be made stale by it.
// - Receives from any source (docs/design.md, "recv from any source"). The receiver binds such a
//   recv to a sender's next message only once that message's send is known ready there: it
//   watches the key; as follower it sees the leader's proposal of the send, as leader it probes
//   (kProbe) and the follower answers once its send is ready (kOffer). Neither claims the send:
//   it stays ready, and is agreed as usual once a recv takes its key. A key under a floor counts
//   as offered (a recv bound to it fails, as a specific one would).
// - Why it cannot deadlock: an item waits only for the peer's word on it (a proposal, a commit,
//   a decision), which the peer sends once it has the item ready, or never if it cancelled it,
//   and then the floors reach this side and fail it. Nothing waits on an item issued later.
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "device/ops.h"

namespace fastcomm {
namespace device {

// One part of an op with the peer, as the agreement sees it.
struct Item {
  Key key;
  Sig sig;
  bool agree_only = false;  // a group-communicator op's agreement: answered, never launched
  void* token = nullptr;    // the engine's Part
};

struct Frame {
  FrameType type = kPropose;
  uint32_t epoch = 0;
  std::vector<Entry> entries;
};

class PairAgreement {
 public:
  enum class Why { kMismatch, kCancelled, kReset };
  struct Failure {
    void* token;
    Why why;
    Sig theirs;  // kMismatch: what the peer issued
  };
  struct Decision {
    void* token;
    bool go;
  };
  // What one call produced; the caller acts on it in this order: failed, launch, answered,
  // decided, then sends the frames.
  struct Out {
    std::vector<Frame> frames;
    std::vector<void*> launch;      // agreed data items, in the channel's order
    std::vector<void*> answered;    // leader: agreement items the peer committed
    std::vector<Decision> decided;  // follower: agreement items the group's leader decided on
    std::vector<void*> awaiting;    // follower: agreement items committed now (they await a decision)
    std::vector<Failure> failed;
    bool new_epoch = false;  // the peer reset the channel: what the engine launched fails, and the
                             // communicator is replaced at the next proposal
    bool released = false;   // the leader released the epoch's communicator: nothing fails, the
                             // next proposal brings a new one
    void clear() {
      frames.clear();
      launch.clear();
      answered.clear();
      decided.clear();
      awaiting.clear();
      failed.clear();
      new_epoch = false;
      released = false;
    }
  };

  explicit PairAgreement(bool leader) : leader_(leader) {}
  bool leader() const { return leader_; }
  uint32_t epoch() const { return epoch_; }

  // An item is ready here (its op's previous op in its group is enqueued).
  void ready(const Item& it, Out& out);
  // Leader: proposes the items made ready since the last call, in one frame.
  void flush(Out& out);
  void receive(const Frame& f, Out& out);
  // This side resets the channel (an op timed out): every item held fails (kReset), and the
  // keys of items the engine launched that have not run (`launched`) are cancelled with them.
  void reset(const std::vector<Key>& launched, Out& out);
  // Leader, holding nothing: the epoch's communicator is released (a kRelease tells the
  // follower); the next proposal starts a new epoch with a new one. False if it holds items.
  bool release(Out& out);

  // A recv from any source would take the peer's send `k` once it is ready (idempotent).
  void watch(const Key& k);
  void unwatch(const Key& k);
  // Whether the peer's send `k` is known ready (or cancelled): a recv bound to it is answered.
  bool offered(const Key& k) const;

  // Whether any item waits for the peer's word (a receive should be posted).
  bool waiting() const;
  // Whether any item is held, watched or probed.
  bool holding() const {
    return !open_.empty() || !awaiting_.empty() || !watched_.empty() || probed_.size() > answered_.size();
  }
  bool has_proposals_to_send() const { return !to_propose_.empty() || !to_probe_.empty(); }
  // Follower: agreement items committed, awaiting the leader's decision.
  size_t awaiting() const { return awaiting_.size(); }

 private:
  bool cancelled(const Key& k) const {
    auto it = floor_.find(k.id);
    return it != floor_.end() && k.seq <= it->second;
  }
  void raise_floor(const Key& k) {
    auto it = floor_.find(k.id);
    if (it == floor_.end() || it->second < k.seq) floor_[k.id] = k.seq;
  }
  void match(Out& out);
  // Fails every held item (`why`); their keys raise this side's floors, returned as entries.
  std::vector<Entry> drop_all(Why why, const std::vector<Key>& launched, Out& out);
  // Takes the peer's floors: held items under them fail (kCancelled).
  void take_floors(const std::vector<Entry>& floors, Out& out);

  const bool leader_;
  uint32_t epoch_ = 0;
  std::unordered_map<Key, Item, KeyHash> open_;  // ready, not yet agreed
  std::deque<Key> to_propose_;                   // leader: ready, not yet proposed
  std::deque<Entry> proposals_;                  // follower: proposed, no matching item yet
  std::unordered_map<Key, Item, KeyHash> awaiting_;  // follower: committed agreement items
  std::unordered_map<uint64_t, uint64_t> floor_;     // per group: sequence numbers cancelled
  // Receives from any source.
  std::unordered_set<Key, KeyHash> watched_;   // keys an unbound recv here would take
  std::deque<Key> to_probe_;                   // leader: probes not sent yet
  std::unordered_set<Key, KeyHash> probed_;    // leader: probes sent (or queued) this epoch
  std::unordered_set<Key, KeyHash> answered_;  // leader: ... and answered (a subset)
  std::unordered_set<Key, KeyHash> probes_;    // follower: probes whose send is not ready here yet
};

}  // namespace device
}  // namespace fastcomm
