// A same-host pair's channel over IPC (device/ipc_link.h): the channel keeps its agreement,
// queues, harvest and faults (channel.cpp); only its transport differs from NCCL's.
#include "common/errors.h"
#include "device/channel_engine.h"

namespace fastcomm {
namespace device {

namespace {
constexpr uint32_t kIpcSlots = 4;
}

bool ChannelEngine::use_ipc(int peer) const {
  return ipc_on_ && (size_t)peer < host_of_.size() && (size_t)rank_ < host_of_.size() &&
         host_of_[peer] == host_of_[rank_];
}

bool ChannelEngine::links_only(const DeviceOp& d) const {
  const size_t n = d.ranks.size();
  if (single_ || !ipc_on_ || n < 3 || (int64_t)n > ipc_group_max_ || d.req.kind == OpKind::kSend ||
      d.req.kind == OpKind::kRecv)
    return false;
  for (int r : d.ranks)
    if (r != rank_ && !use_ipc(r)) return false;
  return true;
}

Comm ChannelEngine::new_link(Channel& c, const UniqueId* leader_id) {
  // The rings' placement with this peer (ipc_link.h): known after the first contact; the
  // follower decides it there, from whether its device can read the leader's ring.
  bool host = host_rings_.count(c.peer) > 0, ask = false;
  if (leader_id != nullptr) {
    if (IpcLink::is_host(*leader_id)) host = true;
    else if (host || !IpcLink::readable(*rt_, *leader_id)) host = ask = true;
  }
  if (host) host_rings_.insert(c.peer);
  auto l = std::make_unique<IpcLink>(*rt_, c.peer, c.agree.epoch(), ipc_ring_bytes_, kIpcSlots, host);
  if (ask) {
    l->ask_host();  // the leader's ring comes again, in host memory (handle_frame)
  } else if (leader_id != nullptr) {
    try {
      l->open_peer(*leader_id);
    } catch (const std::exception&) {
      // The leader's ring is gone (its epoch ended before its proposal got here): the link
      // never becomes ready, and the reset that ended it cancels what was agreed on it.
    }
  }
  c.id = l->id();
  c.id_sent = false;
  ++live_comms_;
  return ipc_->add(std::move(l));
}

void ChannelEngine::leader_opens(Channel& c, IpcLink& l, const UniqueId& id) {
  if (IpcLink::asks_host(id) && !l.host()) {
    // The follower cannot read this side's device ring, which nothing used yet (the link is
    // not ready before this answer): it moves to host memory and goes to the follower again.
    l.rehost();
    ipc_->count_host_ring();
    host_rings_.insert(c.peer);
    l.open_peer(id);
    send_frame(c, kPropose, {}, &l.id());
    return;
  }
  l.open_peer(id);
}

void ChannelEngine::follower_reopens(Channel& c, const UniqueId& id, uint32_t epoch) {
  IpcLink* l = ipc_->find(c.comm);
  if (l == nullptr || l->ready() || l->epoch() != epoch) return;  // a stale epoch's
  try {
    l->open_peer(id);
  } catch (const std::exception&) {
    // Gone (the leader's epoch ended meanwhile): as in new_link, the reset cancels what was agreed.
  }
}

// Agreed parts go onto the pair's stream in agreed order, each after its inputs and its group's
// previous op (as on NCCL: launch in channel.cpp), their chunks as far as the peer's host has
// enqueued what they wait for (ipc_link.h). A part counts as launched once wholly enqueued. New
// parts join only once the link has no chunk held back: their input waits go onto the stream
// behind every chunk of the parts before them, never ahead of one.
bool ChannelEngine::launch_ipc(Channel& c, IpcLink& l) {
  if (!l.ready()) return false;
  bool moved = false;
  if (!c.committed.empty() && !l.pending()) {
    wait_inputs(c);
    for (Part* p : c.committed) {
      if (const size_t folded = l.add(*p, c.stream)) {
        p->op->folds.clear();  // folded from the ring (a pair op: its only fold)
        ring_fold_bytes_ += (int64_t)folded;
      }
      p->state = Part::kLaunched;
      c.launching.push_back(p);
    }
    c.committed.clear();
    moved = true;
  }
  // Read before the peer's counters (pump): an end seen here comes after its last enqueue.
  const bool ended = l.peer_ended();
  const size_t held = l.held();
  if (const size_t n = l.pump()) {
    on_stream(c, n);
    moved = true;
  }
  moved = moved || l.held() != held;  // chunks went: the peer is moving, keep looking
  if (l.pending() && ended)
    throw_comm_error("fastcomm: rank " + std::to_string(rank_) + ": the channel to rank " + std::to_string(c.peer) +
                     " failed: rank " + std::to_string(c.peer) + " ended its side of the link");
  return moved;
}

// The channel's IPC link is about to be retired (the peer released it, or moved to a new epoch):
// the peer has enqueued all it will on it, so what this side holds back, or has committed and
// not added yet, goes now and its parts go in flight; a part that still cannot fails the link.
void ChannelEngine::drain_link(Channel& c) {
  IpcLink* l = ipc_->find(c.comm);
  if (l == nullptr || !l->ready()) return;
  try {
    while ((l->pending() || !c.committed.empty()) && launch_ipc(c, *l)) {
    }
    if (l->pending() || !c.committed.empty())
      throw_comm_error("fastcomm: rank " + std::to_string(rank_) + ": the link to rank " + std::to_string(c.peer) +
                       " ended with transfers the peer never enqueued");
  } catch (const std::exception& e) {
    doom(c, e.what(), /*for_good=*/false);
  }
}

}  // namespace device
}  // namespace fastcomm
