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

Comm ChannelEngine::new_link(Channel& c, const UniqueId* leader_id) {
  auto l = std::make_unique<IpcLink>(*rt_, c.peer, c.agree.epoch(), ipc_ring_bytes_, kIpcSlots);
  if (leader_id != nullptr) {
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

// Agreed parts go onto the pair's stream in agreed order, each after its inputs and its group's
// previous op (as on NCCL: launch in channel.cpp). Nothing here waits for the peer's host.
bool ChannelEngine::launch_ipc(Channel& c, IpcLink& l) {
  if (c.committed.empty() || !l.ready()) return false;
  wait_inputs(c);
  for (Part* p : c.committed) {
    l.enqueue(*p, c.stream);
    p->state = Part::kLaunched;
    c.launching.push_back(p);
  }
  c.committed.clear();
  on_stream(c);
  return true;
}

}  // namespace device
}  // namespace fastcomm
