#pragma once
// A pair channel's transport between two processes of one host, beside NCCL's communicator
// (device/channel_engine.h): a staging ring per direction in device memory the sender owns
// and the receiver maps (Runtime::ipc_create/ipc_open), ordered by flags on the streams.
//
// A message is cut into the ring's slots. Chunk c of a direction uses slot c % K for the u-th
// time (u = c / K + 1). The sender's stream waits until the receiver consumed the slot's
// (u-1)-th use, copies the chunk in and writes filled[slot] = u; the receiver's stream waits for
// filled[slot] >= u, copies the chunk out and writes consumed[slot] = u. Both sides number the
// chunks alike, taking the parts in the channel's agreed order, send chunk i before receive
// chunk i within a part. A small chunk's copy (or fold) and flag write are one entry on the
// stream (Runtime::copy_flag, fold_flag), and a wait the host sees met already is left off:
// a stream takes only so many entries before the host blocks (docs/design.md).
//
// A stream waits only on work already enqueued: a receive chunk's wait goes onto the stream
// once the peer's host has enqueued the matching send (its counter of sends enqueued, a host
// word in its block), a send chunk's wait for room once the peer has enqueued the receive that
// frees the slot; the chunks behind one that may not go yet wait on the host (pump). A wait
// on a write not yet enqueued would hold the hardware queue it sits in, and so other streams'
// work behind it in that queue (CUDA_DEVICE_MAX_CONNECTIONS), which can close a cycle across
// processes; a wait on enqueued work cannot, since that work depends only on work enqueued
// before it.
//
// No deadlock on the hosts either: a chunk held back waits for the peer to enqueue a chunk
// that comes earlier in the one order both sides follow (the peer's send of the same chunk, or
// its receive of the chunk K earlier in this direction), and the peer enqueues in that order.
//
// One link per channel epoch, made by the leader at its first proposal (its handle rides on the
// proposal as the communicator id does) and by the follower when that arrives (its handle goes
// back on its first answer). Ending an epoch (abort) first tells the peer (flags), then
// releases every wait this side enqueued: what is left runs, as work after ncclCommAbort
// completes. Chunks this side had written stay good (a sender may finish and end its side before
// the receiver read them); but a released send that still waited for room overwrites chunks the
// peer has not read, so that is flagged first, and the peer trusts no receive it sees complete
// after seeing the flag. Chunks held back for a peer that ended its side fail their parts at once.
// The peer's ring is unmapped once this side's stream has drained; this side's ring is freed
// once the peer unmapped it, is gone, or never mapped it.
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "device/ops.h"

namespace fastcomm {
namespace device {

class IpcLink {
 public:
  // This side's ring: `ring_bytes` in `slots` slots, in device memory or (`host`) in host
  // memory both processes map (Runtime::ipc_create). `fixed`: a link for CUDA graphs (below).
  IpcLink(Runtime& rt, int peer, uint32_t epoch, size_t ring_bytes, uint32_t slots, bool host, bool fixed = false);
  ~IpcLink();
  IpcLink(const IpcLink&) = delete;
  IpcLink& operator=(const IpcLink&) = delete;

  // What the peer opens this side's ring with, as a channel's communicator id.
  const UniqueId& id() const { return id_; }
  static bool is_ipc(const UniqueId& id);
  // Ring placement, chosen per peer at first contact, the same on both sides: device rings
  // where the follower's device can read the leader's (one device, or peer access), else both in
  // host memory. A follower that cannot read the leader's ring makes its own in host memory and
  // asks for the leader's again there (`ask_host`); the leader, whose ring nothing used yet (its
  // link is not ready before the follower's id), remakes it (`rehost`) and sends it once more.
  static bool is_host(const UniqueId& id);
  static bool readable(Runtime& rt, const UniqueId& id);
  static bool asks_host(const UniqueId& id);
  static bool is_rehosted(const UniqueId& id);
  void ask_host();
  void rehost();
  bool host() const { return host_; }
  // Maps the peer's ring; raises if the id is not one (or the ring is gone).
  void open_peer(const UniqueId& id);
  bool ready() const { return peer_token_ != nullptr; }
  int peer() const { return peer_; }
  uint32_t epoch() const { return epoch_; }
  size_t ring_bytes() const { return slots_ * slot_bytes_; }

  // Takes the part's transfers, cut into chunks, to go onto `s` (every part of the link on the
  // same stream) in order, as pump() lets them. Returns the bytes it will fold straight from the
  // peer's ring (Part::fold_in_ring; both rings cut alike, so each folded chunk was sent from
  // here before): the op's own fold is then done.
  size_t add(const Part& p, Stream s);
  // Enqueues the chunks that may go now (see above); returns how many of the parts added are
  // now wholly on the stream, counting on from the last call, in the order they were added.
  size_t pump();
  // Chunks added and not enqueued yet.
  bool pending() const { return !steps_.empty(); }
  size_t held() const { return steps_.size(); }
  Stream stream() const { return stream_; }
  // Tells the peer the link ended, then releases every wait this side enqueued; safe to repeat.
  void abort();
  // The peer ended its side.
  bool peer_ended() const;
  // ... releasing a send that waited for room: a receive seen complete from now on may hold
  // garbage.
  bool peer_garbage() const;
  // Once nothing runs on the link here: unmaps the peer's ring (telling the peer).
  void close_peer();
  // Whether the peer unmapped this side's ring (or never mapped it).
  bool peer_done() const;
  // Whether the peer claimed this side's ring (it maps it, or did; open_peer's claim).
  bool peer_opened() const;
  // Teardown, with the peer still mapping this side's ring (its stream may still read it): the
  // ring is left to the process's end instead of freed under that mapping (undefined on CUDA).
  void keep_own_ring() { own_token_ = nullptr; }

  // ---- A link for CUDA graphs (`fixed`; device/graph.h). A graph replays the same stream
  // work each time, so its flag waits and writes must hold fixed values: each slot's two flags
  // are consumed and cleared. Per chunk, the sender's stream waits free[slot] >= 1, clears it,
  // copies the chunk in and sets full[slot] = 1; the receiver's waits full[slot] >= 1, clears it,
  // copies the chunk out and sets free[slot] = 1. Each flag is set by one side and cleared by the
  // other only after it saw it set, so sets and clears alternate, and a run ends with every flag
  // as it began (full 0, free 1): every chunk sent in a run is received in it. Nothing is held
  // back on the host: all of a part's chunks go onto the stream at once (a graph's waits point
  // at the peer's run, which the member contract says comes).
  // Starts a new run: chunk i of each direction uses slot i % K in every run alike.
  void restart_fixed() { tx_seq_ = rx_seq_ = 0; }
  // Enqueues the part's transfers on `s` (the same for every part of the link). Never fused:
  // every flag write is a stream write, whose memory barrier orders it after the clear before it.
  void emit_fixed(const Part& p, Stream s);
  // The end of a fixed link: tells the peer it ended; `failed`: also that what this side's runs
  // in flight write from now on may be garbage (it fails its runs), and releases this side's waits.
  void end_fixed(bool failed);
  // Releases every wait this side's runs may hold; the runs' own clears can block a later wait
  // again, so a failed link's owner repeats this until its runs have drained.
  void release_fixed();

  // Test hook: an unused eager link (both sides ready, the same slot count) numbers its chunks
  // from `chunks` on in each direction, its flags as they stand once that many chunks went each
  // way and were consumed; both sides call it alike before their first part.
  void start_at(uint64_t chunks);
  bool skip_rx_waits = false;  // test hook: the receive copies wait for nothing
  // Chunks up to this many bytes go as one entry with their flag (Runtime::copy_flag,
  // fold_flag) on device rings; 0: never (FASTCOMM_DEVICE_IPC_FUSE_BYTES).
  size_t fuse_bytes = 0;

 private:
  // One chunk to enqueue: a send from `src`, or a receive into `dst` (or folded from the ring
  // when `in_ring`: `fold` with its own and destination offsets applied).
  struct Step {
    bool tx = false;
    bool in_ring = false;
    const uint8_t* src = nullptr;
    uint8_t* dst = nullptr;
    size_t n = 0;
    FoldJob fold{};
  };
  void enqueue_tx(const Step& st);
  // One entry for a chunk and its flag: small chunks, rings in device memory.
  bool fused(size_t n) const { return !host_ && n <= fuse_bytes; }
  void enqueue_rx(const Step& st);
  void make_own(bool host, uint16_t flags);
  uint32_t* own_flag(size_t i) const { return own_.flags + i; }
  uint32_t* peer_flag(size_t i) const { return theirs_.flags + i; }

  Runtime& rt_;
  const int peer_;
  const uint32_t epoch_;
  const bool fixed_;
  uint32_t slots_ = 0;
  size_t slot_bytes_ = 0;
  bool host_ = false;
  void* own_token_ = nullptr;
  Runtime::IpcBlock own_;
  void* peer_token_ = nullptr;
  Runtime::IpcBlock theirs_;
  uint32_t peer_slots_ = 0;
  size_t peer_slot_bytes_ = 0;
  uint64_t tx_seq_ = 0, rx_seq_ = 0;  // chunks enqueued, per direction
  std::deque<Step> steps_;             // added, not enqueued yet, in order
  std::deque<uint64_t> part_ends_;     // per part added and not wholly enqueued: its last step's number + 1
  uint64_t steps_added_ = 0, steps_done_ = 0;
  std::vector<uint64_t> tx_wait_, rx_wait_;  // the last use waited on, per flag, uncut (0: none)
  Stream stream_ = nullptr;
  UniqueId id_;
};

// The engine's links: live ones by the Comm handle their channel holds, and ended ones until
// their memory can go.
class IpcLinks {
 public:
  explicit IpcLinks(Runtime& rt) : rt_(rt) {}
  // Where poll() sends the last release of an ended link's memory (a cudaFree may wait for the
  // whole device): a function that runs its argument on another thread. Unset: in poll().
  void set_offload(std::function<void(std::function<void()>)> f) { offload_ = std::move(f); }
  Comm add(std::unique_ptr<IpcLink> l);
  IpcLink* find(Comm c) const {
    if (c == nullptr || live_.empty()) return nullptr;
    auto it = live_.find(c);
    return it == live_.end() ? nullptr : it->second.get();
  }
  // The link's epoch is over: its waits are released now; `drained` (recorded behind its work,
  // or null) tells when its stream is done with it.
  void end(Comm c, EventPtr drained);
  // A link of no channel (a plan's, device/graph.h), ended, its streams drained: its ring goes
  // once the peer has unmapped it (or is gone).
  void retire(std::unique_ptr<IpcLink> l);
  // Releases what can go; true while some ended link still holds memory.
  bool poll(const std::function<bool(int)>& peer_alive);
  // Teardown: the streams have drained; everything goes, but the rings of live peers that still
  // map them (kept: IpcLink::keep_own_ring; counted by kept()).
  void close_all(const std::function<bool(int)>& peer_alive);
  int64_t kept() const { return kept_.load(); }
  // Whether a live peer may still read `l`'s own ring: it mapped it and has not let it go (a
  // ring in host memory is a segment both map, safe to unmap here, so never).
  static bool still_read(const IpcLink& l, const std::function<bool(int)>& peer_alive) {
    return !l.host() && l.peer_opened() && !l.peer_done() && peer_alive(l.peer());
  }
  bool closing() const { return !closing_.empty(); }
  // Links that hold memory, links made so far (one per channel epoch over IPC), and this side's
  // rings' bytes (any thread: debug).
  int64_t blocks() const { return blocks_.load(); }
  int64_t made() const { return made_.load(); }
  int64_t ring_bytes() const { return bytes_.load(); }
  void set_skip_rx_waits(bool on) { skip_rx_waits_ = on; }
  void set_fuse_bytes(size_t n) { fuse_bytes_ = n; }
  // Rings made in host memory (debug "ipc_host_rings").
  void count_host_ring() { ++host_rings_; }
  int64_t host_rings() const { return host_rings_.load(); }

 private:
  struct Closing {
    std::unique_ptr<IpcLink> link;
    EventPtr drained;
    bool peer_closed = false;
  };
  Runtime& rt_;
  std::function<void(std::function<void()>)> offload_;
  std::unordered_map<Comm, std::unique_ptr<IpcLink>> live_;
  std::vector<Closing> closing_;
  std::atomic<int64_t> blocks_{0}, made_{0}, bytes_{0}, host_rings_{0}, kept_{0};
  std::atomic<bool> skip_rx_waits_{false};
  std::atomic<size_t> fuse_bytes_{0};
  void gone(const IpcLink& l) {
    --blocks_;
    bytes_ -= (int64_t)l.ring_bytes();
  }
};

}  // namespace device
}  // namespace fastcomm
