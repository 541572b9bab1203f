// Deadlines, peers gone, and teardown (device/channel_engine.h).
#include "common/errors.h"
#include "device/channel_engine.h"

namespace fastcomm {
namespace device {

namespace {
std::string ms_since(Clock::time_point t, Clock::time_point now) {
  return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(now - t).count()) + " ms";
}
}  // namespace

// Where a part that missed its deadline stands, for the timeout's message: the agreement, the
// launch or the device.
std::string ChannelEngine::waited_for(const Part& p, Channel& c, Clock::time_point now) {
  const DevOp& op = *p.op;
  std::string s = "ready " + ms_since(op.deadline - op.timeout, op.ready_at) + " after issue, ";
  switch (p.state) {
    case Part::kWaiting:
      s += c.leader ? "proposed, not committed by the peer yet" : "not proposed by the peer yet";
      break;
    case Part::kCommitted: {
      s += "agreed, not launched: ";
      std::string why;
      if (c.comm == nullptr) s += "no communicator";
      else if (IpcLink* l = ipc_->find(c.comm)) s += l->ready() ? "link ready" : "the link waits for the peer's ring";
      else if (counts_kernels(c) && !c.slot) s += "waiting for a kernel slot";
      else {
        try {
          const State st = rt_->comm_state(c.comm, &why);
          s += st == State::kPending ? "the communicator is not connected yet"
                                     : st == State::kFailed ? "the communicator failed: " + why : "communicator ready";
        } catch (const std::exception& e) {
          s += e.what();
        }
      }
      break;
    }
    default:
      s += p.launched_at == Clock::time_point{} ? "launched, not on the stream yet"
                                                 : "on the stream for " + ms_since(p.launched_at, now) +
                                                       ", not run on the device yet";
      break;
  }
  return s;
}

// Deadlines, and peers the host knows are gone.
bool ChannelEngine::check_health() {
  const auto now = Clock::now();
  bool moved = false;
  for (auto& op : live_) {
    if (op->finished || !op->ready || now <= op->deadline) continue;
    if (op->gc != nullptr && op->parts_left == 0) {
      fault_group(*op->gc, "fastcomm: rank " + std::to_string(rank_) + ", group " + op->label + ": " +
                               op_kind_name(op->kind) + " did not finish within the group's timeout (" +
                               std::to_string(op->timeout.count()) + " ms); the group's communicator was aborted");
      moved = true;
      continue;
    }
    for (auto& p : op->parts) {
      if (p->state == Part::kDone || p->held_back) continue;
      Channel& c = channel(p->peer);
      reset(c, "fastcomm: rank " + std::to_string(rank_) + ", group " + op->label + ": " + op_kind_name(op->kind) +
                   " did not finish within the group's timeout (" + std::to_string(op->timeout.count()) +
                   " ms) waiting for rank " + std::to_string(p->peer) + " (" + waited_for(*p, c, now) +
                   "); the channel to rank " + std::to_string(p->peer) + " was reset");
      moved = true;
    }
  }
  if (now - last_health_ < std::chrono::milliseconds(50)) return moved;
  last_health_ = now;
  for (auto it = last_end_.begin(); it != last_end_.end();) {
    if (rt_->query(it->second.second->ev) == State::kReady) it = last_end_.erase(it);
    else ++it;
  }
  ipc_->poll([this](int peer) { return host_.peer_alive(peer); });
  if (!single_) {
    recycle_joins();
    release_idle(now);
    release_idle_groups(now);
  }
  for (auto& [id, g] : groups_) {
    if (g->failed || !g->busy()) continue;
    for (int r : g->ranks) {
      if (r == rank_ || host_.peer_alive(r)) continue;
      if (g->doomed_why.empty()) {
        g->doomed_why = "fastcomm: rank " + std::to_string(rank_) + ": peer rank " + std::to_string(r) + " " +
                        host_.peer_gone_how(r) + "; the communicator of its group was aborted";
        g->doomed_at = now + std::chrono::milliseconds(100);
      }
      moved = true;
      break;
    }
  }
  std::vector<Channel*> chans;
  for (auto& [peer, c] : channels_) chans.push_back(c.get());
  for (Channel* c : chans) {
    const int peer = c->peer;
    IpcLink* link = ipc_->find(c->comm);
    if (link != nullptr && !c->busy() && c->tx.empty() && link->peer_ended()) {
      // The peer ended its side (it shut down, or a reset there raced this idle channel): unmap
      // its ring now; the pair's next proposal brings a new link.
      end_comm(c->comm, /*abort=*/false);
      c->comm = nullptr;
      c->id_sent = false;
      moved = true;
    }
    if (c->failed || !c->busy()) continue;
    if (!host_.peer_alive(peer)) {
      doom(*c, "fastcomm: rank " + std::to_string(rank_) + ": peer rank " + std::to_string(peer) + " " +
                   host_.peer_gone_how(peer) + "; its channel was aborted");
      moved = true;
    }
  }
  return moved;
}

void ChannelEngine::teardown() {
  std::exception_ptr why = broken();
  // Ops posted before the engine stopped, not yet taken in: they fail with the rest.
  std::vector<std::unique_ptr<DevOp>> in;
  std::vector<std::unique_ptr<IpcLink>> retired;
  std::vector<std::shared_ptr<void>> rest;
  {
    std::lock_guard<std::mutex> lk(mu_);
    in.swap(incoming_);
    retired.swap(retired_links_);  // stop_ is set: no more come (retire_links frees them itself)
    rest.swap(retired_rest_);
  }
  rest.clear();
  for (auto& l : retired) ipc_->retire(std::move(l));
  for (auto& op : in) {
    DevOp* o = op.get();
    live_.push_back(std::move(op));
    fail_op(o, why);
    abandon(o);
  }
  // Ops still open may wait on a peer for good: their channels are aborted, so every stream
  // drains, and their Works fail.
  std::string down = "fastcomm: rank " + std::to_string(rank_) + ": fastcomm was shut down";
  try {
    if (why) std::rethrow_exception(why);  // the engine's own failure, where that ended it
  } catch (const c10::Error& e) {
    down = e.what_without_backtrace();
  } catch (...) {
  }
  // A device call that fails here means the device is lost (a sticky error): what is left is
  // failed and let go without device work. Nothing may escape: this runs at the end of the
  // engine thread.
  bool lost = false;
  auto guarded = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception&) {
      lost = true;
    }
  };
  std::vector<Channel*> chans;
  for (auto& [peer, c] : channels_) chans.push_back(c.get());
  for (Channel* c : chans)
    if (c->busy()) guarded([&] { fault(*c, down); });
  for (auto& [id, g] : groups_)
    if (g->busy()) guarded([&] { fault_group(*g, down); });
  guarded([&] { flush_ends(); });
  if (lost) {
    const std::exception_ptr e = why ? why : comm_error_ptr(down);
    for (auto& op : live_) fail_op(op.get(), e);  // their end work is none now
    guarded([&] { flush_ends(); });
  }
  for (auto& op : live_) {
    if (!op->finished) {
      fail_op(op.get(), why);
      abandon(op.get());
    }
  }
  guarded([&] { flush_ends(); });
  for (auto& b : ending_) {
    // What is left on the streams drains (its communicators are aborted): wait so its memory
    // outlives it.
    try {
      for (auto& [s, e] : b->ends) rt_->synchronize(e->ev);
      settle(*b, b->error);
    } catch (const std::exception&) {
      settle(*b, why);
    }
  }
  ending_.clear();
  live_.clear();
  tail_.clear();
  last_end_.clear();
  publisher_.stop();
  for (auto& [peer, c] : channels_) {
    if (c->comm != nullptr) end_comm(c->comm, /*abort=*/false);
    for (Comm r : c->retired) end_comm(r, /*abort=*/false);
    try {
      if (c->stream != nullptr && c->stream != shared_) rt_->destroy_stream(c->stream);
    } catch (const std::exception&) {
    }
  }
  channels_.clear();
  for (auto& [id, g] : groups_) {
    if (g->comm != nullptr) end_group_comm(*g, /*abort=*/false);
    try {
      if (g->stream != nullptr) rt_->destroy_stream(g->stream);
    } catch (const std::exception&) {
    }
  }
  groups_.clear();
  aborter_.stop();  // the aborts of the channels failed above, side by side
  // The channels' streams have drained. A live peer unmaps this side's rings once it sees them
  // ended (its health check): a short wait for that, then they go regardless.
  const auto until = Clock::now() + std::chrono::milliseconds(500);
  guarded([&] {
    while (ipc_->poll([this](int peer) { return host_.peer_alive(peer); }) && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  });
  guarded([&] { ipc_->close_all([this](int peer) { return host_.peer_alive(peer); }); });
  for (auto& [id, s] : joins_) {
    try {
      rt_->destroy_stream(s);
    } catch (const std::exception&) {
    }
  }
  joins_.clear();
  for (Stream s : free_joins_) {
    try {
      rt_->destroy_stream(s);
    } catch (const std::exception&) {
    }
  }
  free_joins_.clear();
  try {
    if (shared_ != nullptr) rt_->destroy_stream(shared_);
    rt_->destroy_stream(alloc_);
  } catch (const std::exception&) {
  }
}

}  // namespace device
}  // namespace fastcomm
