// The device engine's thread (device/channel_engine.h): its loop, ops admitted and chained in
// their group's order, made ready and handed to their channels' agreement, and one pass over
// the channels, group communicators, health and ending batches.
#include <algorithm>
#include <cstdio>

#include "common/errors.h"
#include "device/channel_engine.h"

namespace fastcomm {
namespace device {

namespace {

// Passes the engine thread yields between before it sleeps while ops are live.
constexpr int kYieldPasses = 200;

}  // namespace

void ChannelEngine::main() {
  // This thread's event queries and syncs must not break a CUDA graph the caller captures
  // meanwhile in the global capture mode.
  try {
    rt_->relax_capture_mode();
  } catch (const std::exception&) {
  }
  std::unique_lock<std::mutex> lk(mu_);
  int idle = 0;
  while (!stop_) {
    std::vector<std::unique_ptr<DevOp>> in;
    in.swap(incoming_);
    std::vector<std::unique_ptr<IpcLink>> retired;
    retired.swap(retired_links_);
    std::vector<std::shared_ptr<void>> rest;
    rest.swap(retired_rest_);
    lk.unlock();
    rest.clear();
    bool moved = false;
    try {
      for (auto& l : retired) ipc_->retire(std::move(l));
      for (auto& op : in) admit(std::move(op));
      moved = pass();
    } catch (const std::exception& e) {
      // A runtime call failed outside any one channel (an event, a join stream): nothing can
      // be trusted any more.
      std::lock_guard<std::mutex> g(mu_);
      if (!broken_) broken_ = comm_error_ptr(std::string("fastcomm: rank ") + std::to_string(rank_) +
                                             ": the device engine failed: " + e.what());
      stop_ = true;
    }
    lk.lock();
    if (moved || !incoming_.empty() || woken_) {
      woken_ = false;
      idle = 0;
      continue;
    }
    // A control frame wakes this thread (wake()); device events do not, so they are polled.
    if (live_.empty() && ending_.empty() && live_comms_.load() == 0 && group_comms_.load() == 0 && joins_.empty() &&
        !ipc_->closing()) {
      cv_.wait(lk, [&] { return stop_ || !incoming_.empty() || woken_; });
    } else if (live_.empty() && ending_.empty()) {
      // Idle, with communicators or join streams to release in time, and the peers' frames
      // (a release) to read.
      cv_.wait_for(lk, std::chrono::milliseconds(50), [&] { return stop_ || !incoming_.empty() || woken_; });
    } else {
      // Device events are polled, and the host link driven (isCompleted polls it): a few
      // hundred passes that yield the core between them, then backing off while nothing moves.
      idle = std::min(idle + 1, kYieldPasses + 50);
      if (idle <= kYieldPasses) {
        lk.unlock();
        std::this_thread::yield();
        lk.lock();
        continue;
      }
      const int slow = idle - kYieldPasses;
      cv_.wait_for(lk, std::chrono::microseconds(slow < 20 ? 5 * slow : 200),
                   [&] { return stop_ || !incoming_.empty() || woken_; });
    }
  }
  lk.unlock();
  // Teardown may drop the engine's last reference (a Work it fails): held until teardown is
  // over, so the engine is destroyed, if here at all, once this thread no longer touches it.
  std::shared_ptr<ChannelEngine> self = weak_from_this().lock();
  try {
    teardown();
  } catch (const std::exception& e) {
    // (teardown lets nothing escape on purpose; an exception out of this thread would end the
    // process, the users' error unread)
    std::fprintf(stderr, "fastcomm: rank %d: the device engine's teardown failed: %s\n", rank_, e.what());
  }
  torn_down_.store(true);
}

void ChannelEngine::admit(std::unique_ptr<DevOp> op) {
  DevOp* o = op.get();
  live_.push_back(std::move(op));  // first: whatever throws below, teardown still fails it
  if (o->unbound) {
    ports_.post(o->port, RecvPorts::Recv{o, o->any_source, o->from});
    unbound_.push_back(o);
    return;
  }
  chain(o);
}

// The op joins its group's order: ready now, or once the previous op is enqueued.
void ChannelEngine::chain(DevOp* o) {
  if (o->group_op) {
    auto& g = groups_[o->key.id];
    if (!g) {
      g = std::make_unique<GroupComm>();
      g->ranks = o->ranks;
      g->me = o->me;
    }
    o->gc = g.get();
  }
  auto it = tail_.find(o->key.id);
  DevOp* pred = it == tail_.end() ? nullptr : it->second;
  tail_[o->key.id] = o;
  if (single_ || pred == nullptr || pred->launched) {
    if (pred != nullptr) {
      o->pred_end = pred->end;
      o->pred_stream = pred->end_stream;
    } else {
      auto e = last_end_.find(o->key.id);
      if (e != last_end_.end()) {
        o->pred_stream = e->second.first;
        o->pred_end = e->second.second;
      }
    }
    make_ready(o);
  } else {
    pred->next = o;
  }
}

// The group's previous op is enqueued: this op's parts may be agreed with the peers.
void ChannelEngine::make_ready(DevOp* op) {
  op->ready = true;
  op->ready_at = Clock::now();
  if (op->gc != nullptr && op->gc->failed) {
    // Agreed all the same, so that no member waits for an answer: the flag makes the other
    // side refuse it.
    fail_op(op, op->gc->failed);
    for (auto& p : op->parts) p->sig.flags |= kGroupBroken;
  }
  if (op->parts.empty()) {
    if (op->gc != nullptr) abandon(op);
    else to_end_.push_back(op);
    return;
  }
  if (propose_in_turn(op)) return;
  std::vector<Part*> skip;
  if (DevOp* rs = op->scattered) {
    // The all-gather after a failed reduce-scatter fails too, on every member: with a peer
    // that saw the mismatch (it may have no all-gather at all) it is not agreed; with the
    // others it is agreed flagged, so that they fail theirs at once rather than time out.
    op->scattered = nullptr;
    if (rs->error) {
      fail_op(op, rs->error);
      for (size_t i = 0; i < op->parts.size(); ++i) {
        Part* p = op->parts[i].get();
        p->sig.flags |= kGroupBroken;
        if (i < rs->parts.size() && rs->parts[i]->mismatched) skip.push_back(p);
      }
    }
  }
  for (auto& up : op->parts) {
    if (std::find(skip.begin(), skip.end(), up.get()) == skip.end()) ready_part(up.get());
  }
  for (Part* p : skip) fail_part(p, op->error);
}

// The part is handed to its channel's agreement.
void ChannelEngine::ready_part(Part* p) {
  p->held_back = false;
  Channel& c = channel(p->peer);
  if (c.failed) {
    fail_part(p, c.failed);
    return;
  }
  if (single_) {
    c.wants_comm = true;
    single_queue_.push_back(p);
    return;
  }
  PairAgreement::Out out;
  c.agree.ready(Item{p->op->key, p->sig, p->agree_only, p}, out);
  try {
    apply(c, out);  // a follower's commit goes out at once
  } catch (const std::exception& e) {
    doom(c, e.what());  // the control path failed: the peer's channel only
  }
}

bool ChannelEngine::pass() {
  bool moved = false;
  // Finishing an op may make the next one of its group ready and so make a channel: walk a
  // snapshot (channels are never removed before teardown).
  std::vector<Channel*>& chans = pass_channels_;
  chans.clear();
  for (auto& [peer, c] : channels_) chans.push_back(c.get());
  if (single_) moved |= launch_single();
  moved |= bind_receives();
  for (Channel* c : chans) {
    try {
      moved |= pump(*c);
    } catch (const std::exception& e) {
      doom(*c, e.what());
      moved = true;
    }
    flush_ends();
  }
  std::vector<GroupComm*>& gcs = pass_groups_;
  gcs.clear();
  for (auto& [id, g] : groups_) gcs.push_back(g.get());
  for (GroupComm* g : gcs) {
    try {
      moved |= pump_group(*g);
    } catch (const std::exception& e) {
      fault_group(*g, e.what());
      moved = true;
    }
    flush_ends();
  }
  moved |= check_health();
  flush_ends();
  if (awaiting_wanted_.load(std::memory_order_relaxed)) {  // a test asked (debug hook only)
    int64_t awaiting = 0;
    for (Channel* c : chans) awaiting += (int64_t)c->agree.awaiting();
    awaiting_decision_.store(awaiting);
  }
  moved |= settle_ended();
  // Drop ops that are over and that no later op of their group points to.
  live_.erase(std::remove_if(live_.begin(), live_.end(),
                             [&](const std::unique_ptr<DevOp>& o) {
                               if (!o->finished) return false;
                               auto it = tail_.find(o->key.id);
                               if (it != tail_.end() && it->second == o.get()) tail_.erase(it);
                               return true;
                             }),
              live_.end());
  return moved;
}

}  // namespace device
}  // namespace fastcomm
