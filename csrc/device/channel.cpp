// A pair's channel (device/channel_engine.h): the agreement frames, launches in agreed order,
// harvest of what ran, faults.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "common/errors.h"
#include "device/channel_engine.h"

namespace fastcomm {
namespace device {

Channel& ChannelEngine::channel(int peer) {
  auto& c = channels_[peer];
  if (!c) {
    c = std::make_unique<Channel>(peer, rank_ < peer);
    c->stream = shared_;
  }
  return *c;
}

Comm ChannelEngine::new_comm(const UniqueId& id, int nranks, int rank) {
  Comm c = rt_->comm_init(id, nranks, rank);
  ++live_comms_;
  return c;
}

void ChannelEngine::end_comm(Comm c, bool abort) {
  --live_comms_;
  ++ended_comms_;
  if (IpcLink* l = ipc_->find(c)) {
    // Its waits are released at once; its memory goes once its stream is past it. (A record
    // fails only on a broken device, which runs nothing more.)
    EventPtr drained;
    try {
      if (l->stream() != nullptr) drained = events_->record(l->stream());
    } catch (const std::exception&) {
    }
    ipc_->end(c, std::move(drained));
    return;
  }
  retire_comm(c, abort);
}

// Off the engine thread: an abort can block for seconds, and so can a destroy (NCCL's finalize
// waits for the communicator's work; freeing its memory may wait for the device's). Nothing
// here touches `c` again.
void ChannelEngine::retire_comm(Comm c, bool abort) {
  Runtime* rt = rt_.get();
  aborter_.push([rt, c, abort] {
    try {
      rt->relax_capture_mode();  // NCCL syncs its streams: that must not break a user's capture
      if (abort) rt->comm_abort(c);
      rt->comm_destroy(c);
    } catch (const std::exception&) {
    }
  });
}

void ChannelEngine::release_idle(Clock::time_point now) {
  std::vector<Channel*> idle;
  size_t live = 0;
  for (auto& [peer, c] : channels_) {
    if (c->comm == nullptr) continue;
    ++live;
    if (c->leader && !c->failed && c->doomed_why.empty() && !c->busy() && c->tx.empty() && c->retired.empty())
      idle.push_back(c.get());
  }
  std::sort(idle.begin(), idle.end(), [](Channel* a, Channel* b) { return a->last_used < b->last_used; });
  for (Channel* c : idle) {
    if (now - c->last_used < idle_release_ && live <= max_comms_) break;
    PairAgreement::Out out;
    if (!c->agree.release(out)) continue;
    end_comm(c->comm, /*abort=*/false);  // nothing runs on it
    c->comm = nullptr;
    c->id_sent = false;
    --live;
    try {
      apply(*c, out);
    } catch (const std::exception& e) {
      doom(*c, e.what());
    }
  }
}

void ChannelEngine::fail_part(Part* p, std::exception_ptr e) {
  fail_op(p->op, std::move(e));
  p->state = Part::kDone;
  part_launched(p);
  part_done(p);
}

bool ChannelEngine::pump(Channel& c) {
  bool moved = false;
  if (c.failed) return false;
  // A reset of the peer's may be what failed the communicator: its frames are still read.
  if (c.doomed_why.empty() || !c.doomed_for_good) moved |= exchange(c);  // a failed control path dooms it (the caller)
  if (c.doomed_why.empty()) {
    try {
      moved |= launch(c);
    } catch (const std::exception& e) {
      // The communicator failed (the peer aborted it in a reset of its own, or exited): what
      // ran is harvested first, then a new epoch; a peer that is gone is found by the health
      // check, which fails the channel for good.
      doom(c, e.what(), /*for_good=*/false);
      moved = true;
    }
  }
  // Transfers seen done, in launch order (a channel's stream runs them in that order).
  IpcLink* link = ipc_->find(c.comm);
  while (!c.in_flight.empty()) {
    Part* p = c.in_flight.front();
    const bool ran = rt_->query(p->done_event->ev) == State::kReady;
    // Read after the event: a receive that completed since the peer released a waiting send
    // may hold garbage.
    if (link != nullptr && link->peer_garbage()) {
      if (c.doomed_why.empty())
        doom(c, "fastcomm: rank " + std::to_string(rank_) + ": the channel to rank " + std::to_string(c.peer) +
                    " failed: rank " + std::to_string(c.peer) + " ended its side of the link", /*for_good=*/false);
      if (link->peer_garbage()) break;
    }
    if (!ran) break;
    c.in_flight.pop_front();
    p->state = Part::kDone;
    part_done(p);
    c.last_used = Clock::now();
    moved = true;
  }
  if (c.slot && c.committed.empty() && c.launching.empty() && c.in_flight.empty() && c.held.empty()) {
    drop_slot(c);
    moved = true;
  }
  if (!c.retired.empty() && c.in_flight.empty() && c.launching.empty()) {
    for (Comm r : c.retired) end_comm(r, /*abort=*/false);
    c.retired.clear();
  }
  if (!c.doomed_why.empty() && (c.in_flight.empty() || Clock::now() > c.doomed_at)) {
    const std::string why = std::move(c.doomed_why);
    c.doomed_why.clear();
    if (c.doomed_for_good) fault(c, why);
    else reset(c, why);
    moved = true;
  }
  return moved;
}

void ChannelEngine::doom(Channel& c, const std::string& why, bool for_good) {
  if (c.failed) return;
  if (!c.doomed_why.empty()) {
    c.doomed_for_good = c.doomed_for_good || for_good;
    if (for_good) c.doomed_why = why;
    return;
  }
  c.doomed_why = why;
  c.doomed_for_good = for_good;
  c.doomed_at = Clock::now() + std::chrono::milliseconds(100);
}

// The control messages of the pair: what the agreement sends, and whatever the peer sent in.
bool ChannelEngine::exchange(Channel& c) {
  bool moved = false;
  while (!c.tx.empty() && c.tx.front().first->isCompleted()) {
    auto [w, buf] = std::move(c.tx.front());
    c.tx.pop_front();
    if (auto e = w->exception()) std::rethrow_exception(e);
    frame_pool_.push_back(std::move(buf));
    moved = true;
  }
  if (single_ && c.leader && c.comm == nullptr && c.wants_comm) {
    c.id = rt_->new_id();
    c.comm = new_comm(c.id, 2, 0);
    send_frame(c, kPropose, {}, &c.id);
    c.id_sent = true;
  }
  if (c.agree.has_proposals_to_send()) {
    PairAgreement::Out out;
    c.agree.flush(out);
    apply(c, out);
    moved = true;
  }
  // A receive is kept posted while anything here waits for the peer's word, or runs on the
  // device (a reset of the peer's may cancel it).
  auto needs_word = [&] {
    return c.agree.waiting() || (!single_ && (!c.committed.empty() || !c.launching.empty() || !c.in_flight.empty())) ||
           // the leader may release it, or a group communicator of a group it leads
           (!single_ && !c.leader && (c.comm != nullptr || group_comms_.load() > 0)) ||
           (single_ && c.comm == nullptr && c.wants_comm);
  };
  for (;;) {
    if (!c.rx) {
      if (!needs_word()) break;
      if (!c.rx_buf.defined()) c.rx_buf = at::empty({(int64_t)kFrameBytes}, at::kByte);
      c.rx = host_.control_recv(c.peer, c.rx_buf);
      // The peer's word wakes this thread (no timer on the agreement's path).
      std::weak_ptr<ChannelEngine> self = weak_from_this();
      c.rx->getFuture()->addCallback([self](c10::ivalue::Future&) {
        if (auto e = self.lock()) e->wake();
      });
    }
    if (!c.rx->isCompleted()) break;
    auto w = std::move(c.rx);
    if (auto e = w->exception()) std::rethrow_exception(e);
    handle_frame(c, (const uint8_t*)c.rx_buf.data_ptr());
    moved = true;
  }
  return moved;
}

void ChannelEngine::send_frame(Channel& c, FrameType type, const std::vector<Entry>& entries, const UniqueId* id) {
  // At least one frame, entries or not (an id, a release, a reset with no floors).
  for (size_t at = 0; at == 0 || at < entries.size(); at += kMaxEntries) {
    at::Tensor buf;
    if (!frame_pool_.empty()) {
      buf = std::move(frame_pool_.back());
      frame_pool_.pop_back();
    } else {
      buf = at::empty({(int64_t)kFrameBytes}, at::kByte);
    }
    auto* d = (uint8_t*)buf.data_ptr();
    FrameHead h;
    h.type = type;
    h.count = (uint32_t)std::min(kMaxEntries, entries.size() - at);
    h.has_id = id != nullptr && at == 0;
    h.epoch = c.agree.epoch();
    std::memcpy(d, &h, sizeof(h));
    if (h.has_id) std::memcpy(d + sizeof(h), id, sizeof(UniqueId));
    else std::memset(d + sizeof(h), 0, sizeof(UniqueId));
    std::memcpy(d + sizeof(h) + sizeof(UniqueId), entries.data() + at, h.count * sizeof(Entry));
    auto w = host_.control_send(c.peer, buf);
    c.tx.emplace_back(std::move(w), std::move(buf));
  }
}

void ChannelEngine::handle_frame(Channel& c, const uint8_t* d) {
  FrameHead h;
  std::memcpy(&h, d, sizeof(h));
  TORCH_INTERNAL_ASSERT(h.count <= kMaxEntries && h.type >= kPropose && h.type <= kOffer, "bad control frame");
  Frame f;
  f.type = (FrameType)h.type;
  f.epoch = h.epoch;
  f.entries.resize(h.count);
  std::memcpy(f.entries.data(), d + sizeof(h) + sizeof(UniqueId), h.count * sizeof(Entry));
  UniqueId id;
  if (h.has_id) std::memcpy(&id, d + sizeof(h), sizeof(UniqueId));
  if (f.type == kGroupRelease) {
    // Not the pair's business (no epoch): a group communicator this rank is a member of.
    for (const Entry& e : f.entries) {
      auto g = groups_.find(e.key.id);
      if (g != groups_.end()) {
        g->second->release_pending = true;
        ++group_releases_heard_;
      }
    }
    return;
  }
  if (f.type == kReset && f.epoch > c.agree.epoch()) {
    // Everything launched in the old epoch fails with what the peer cancelled; a failure of its
    // communicator seen here meanwhile was that reset.
    if (!c.doomed_for_good) c.doomed_why.clear();
    drop_epoch(c, comm_error_ptr("fastcomm: rank " + std::to_string(rank_) + ": cancelled: rank " +
                                 std::to_string(c.peer) + " reset the channel between the two (an op there missed its group's timeout)"));
  }
  // (>=: a reset that crossed this side's own, or a release.)
  if (f.type == kReset && f.epoch >= c.agree.epoch())
    cancel_undecided(c, "rank " + std::to_string(c.peer) + " reset the channel between the two");
  const bool rehosted = h.has_id && IpcLink::is_ipc(id) && IpcLink::is_rehosted(id);
  if (rehosted && !c.leader) {
    follower_reopens(c, id, f.epoch);  // the leader's ring again, in host memory: no new link
  } else if (h.has_id && f.type == kPropose && !c.leader && f.epoch >= c.agree.epoch()) {
    // The pair's communicator for this epoch, made at its first proposal. The leader sends an
    // id only with a new communicator: one still held here is done with (what runs on it ends).
    if (c.comm != nullptr) {
      drain_link(c);
      c.retired.push_back(c.comm);
    }
    c.id = id;
    c.comm = IpcLink::is_ipc(id) ? new_link(c, &id) : new_comm(c.id, 2, 1);
    if (c.stream == nullptr) c.stream = rt_->new_stream();
  }
  if (h.has_id && c.leader && f.epoch == c.agree.epoch()) {
    // The follower's answer to an IPC link's first proposal carries its own ring.
    IpcLink* l = ipc_->find(c.comm);
    if (l != nullptr && !l->ready() && l->epoch() == f.epoch) leader_opens(c, *l, id);
  }
  if (single_) return;  // the single-stream scheme agrees on nothing
  PairAgreement::Out out;
  c.agree.receive(f, out);
  if (out.released && c.comm != nullptr) {
    // What already runs on it finishes first (pump destroys it then).
    drain_link(c);
    c.retired.push_back(c.comm);
    c.comm = nullptr;
    c.id_sent = false;
  }
  apply(c, out, h.has_id && f.type == kGo ? &id : nullptr);
}

void ChannelEngine::apply(Channel& c, PairAgreement::Out& out, const UniqueId* go_id) {
  // Built only for a failure: apply runs for every op made ready and every frame.
  auto me_str = [&] { return "fastcomm: rank " + std::to_string(rank_); };
  for (auto& fl : out.failed) {
    const std::string me = me_str();
    Part* p = static_cast<Part*>(fl.token);
    std::string why;
    switch (fl.why) {
      case PairAgreement::Why::kMismatch:
        p->mismatched = true;
        why = me + ", group " + p->op->label + ": mismatched op: this rank issued " + sig_str(p->sig) + " where rank " +
              std::to_string(c.peer) + " issued " + sig_str(fl.theirs);
        break;
      case PairAgreement::Why::kCancelled:
        why = me + ", group " + p->op->label + ": " + op_kind_name(p->op->kind) + " cancelled: the channel to rank " +
              std::to_string(c.peer) + " was reset after an op missed its group's timeout" +
              (c.reset_why.empty() ? std::string(" on rank ") + std::to_string(c.peer) : ": " + c.reset_why);
        break;
      case PairAgreement::Why::kReset:
        why = c.reset_why.empty() ? me + ", group " + p->op->label + ": " + op_kind_name(p->op->kind) +
                                        " cancelled: rank " + std::to_string(c.peer) +
                                        " reset the channel between the two (an op there missed its group's timeout)"
                                  : c.reset_why;
        break;
    }
    fail_part(p, comm_error_ptr(why));
  }
  for (void* t : out.launch) {
    Part* p = static_cast<Part*>(t);
    p->state = Part::kCommitted;
    c.committed.push_back(p);
  }
  for (void* t : out.answered) {
    Part* p = static_cast<Part*>(t);
    p->agreed = true;
    p->state = Part::kDone;
    part_done(p);
  }
  if (group_slots()) {
    for (void* t : out.awaiting) {
      DevOp* op = static_cast<Part*>(t)->op;
      op->awaits_go = true;  // its commit holds the group's slot until the decision (agreed())
      ++op->gc->awaiting;
    }
  }
  for (auto& dc : out.decided) {
    Part* p = static_cast<Part*>(dc.token);
    GroupComm& g = *p->op->gc;
    if (dc.go && go_id != nullptr) {
      // A new communicator for the group (its first, or one after a release): it replaces the
      // one held here once what runs on that is over (pump_group).
      g.next_id = *go_id;
      g.has_next = true;
      ++group_next_ids_;
    }
    if (!dc.go)
      fail_op(p->op, comm_error_ptr(me_str() + ", group " + p->op->label + ": " + op_kind_name(p->op->kind) +
                                    " refused by the group's rank 0 (rank " + std::to_string(c.peer) +
                                    "): another member issued a mismatched op"));
    p->state = Part::kDone;
    part_done(p);
  }
  for (Frame& f : out.frames) {
    if (f.type == kCommit && !c.leader && !out.awaiting.empty() && group_slots() && hold_group_commits(f)) continue;
    if (f.type == kCommit && !c.leader && !out.launch.empty() && counts_kernels(c) &&
        (!c.slot || !c.held.empty())) {
      // The kernel bound: this commit goes out once the channel holds a slot (launch()).
      c.held.push_back(std::move(f));
      continue;
    }
    const UniqueId* id = nullptr;
    if (f.type == kPropose && c.leader) {
      if (c.comm == nullptr) {
        // A new epoch's (or the pair's first) communicator: its id rides on the first proposal.
        if (use_ipc(c.peer)) {
          c.comm = new_link(c, nullptr);
        } else {
          c.id = rt_->new_id();
          c.comm = new_comm(c.id, 2, 0);
        }
        if (c.stream == nullptr) c.stream = rt_->new_stream();
        c.id_sent = false;
      }
      if (!c.id_sent) id = &c.id;
      c.id_sent = true;
    } else if (!c.leader && !c.id_sent && ipc_->find(c.comm) != nullptr) {
      id = &c.id;  // the follower's ring, on its first answer
      c.id_sent = true;
    }
    send_frame(c, f.type, f.entries, id);
  }
}

// Agreed parts go onto the pair's stream, in agreed order, as one group of sends and receives.
// Each waits first for its inputs (the caller's stream at issue) and for its group's previous
// op, both enqueued before it: a stream never waits on work enqueued after it.
void ChannelEngine::wait_inputs(Channel& c) {
  Event last_input = nullptr, last_pred = nullptr;
  for (Part* p : c.committed) {
    DevOp* op = p->op;
    if (op->input->ev != last_input) rt_->wait(c.stream, last_input = op->input->ev);
    if (op->pred_end && op->pred_stream != c.stream && op->pred_end->ev != last_pred)
      rt_->wait(c.stream, last_pred = op->pred_end->ev);
  }
}

void ChannelEngine::on_stream(Channel& c, size_t n) {
  EventPtr ev = events_->record(c.stream);
  const auto now = Clock::now();
  n = std::min(n, c.launching.size());
  for (size_t i = 0; i < n; ++i) {
    Part* p = c.launching[i];
    p->done_event = ev;
    p->stream = c.stream;
    p->launched_at = now;
    c.in_flight.push_back(p);
    part_launched(p);
  }
  c.launching.erase(c.launching.begin(), c.launching.begin() + (long)n);
  c.last_used = now;
}

bool ChannelEngine::counts_kernels(const Channel& c) {
  return max_kernels_ > 0 && !single_ && c.comm != nullptr && ipc_->find(c.comm) == nullptr;
}

bool ChannelEngine::take_slot(SlotUser& u) {
  if (u.slot) return true;
  const bool fresh = !u.slot_queued;
  if (fresh) {
    u.slot_queued = true;
    slot_queue_.push_back(&u);
  }
  grant_slots();
  if (!u.slot && fresh) ++slot_waits_;
  return u.slot;
}

void ChannelEngine::drop_slot(SlotUser& u) {
  if (!u.slot) return;
  u.slot = false;
  --kernels_;
  grant_slots();
}

// Free slots go to the queued channels and groups in request order; one that no longer wants
// one (a reset, a fault took its parts) is skipped, so no stale entry holds the line.
void ChannelEngine::grant_slots() {
  while (kernels_ < max_kernels_ && !slot_queue_.empty()) {
    SlotUser* n = slot_queue_.front();
    slot_queue_.pop_front();
    n->slot_queued = false;
    if (n->slot || !n->wants_slot()) continue;
    n->slot = true;
    ++kernels_;
  }
  slots_held_ = kernels_;
}

void ChannelEngine::send_held(Channel& c) {
  auto held = std::move(c.held);
  c.held.clear();
  for (Frame& f : held) send_frame(c, f.type, f.entries, nullptr);
}

bool ChannelEngine::launch(Channel& c) {
  if (c.comm == nullptr || (c.committed.empty() && c.launching.empty())) return false;
  if (IpcLink* l = ipc_->find(c.comm)) return launch_ipc(c, *l);
  bool moved = false;
  // The kernel bound: committed parts go onto the stream only while the channel holds a slot;
  // without one they wait for a harvest here or on another channel, and nothing else does.
  const bool gated = !c.committed.empty() && counts_kernels(c) && !take_slot(c);
  if (c.slot && !c.held.empty()) {
    send_held(c);
    moved = true;
  }
  std::string why;
  State state = rt_->comm_state(c.comm, &why);
  if (state == State::kReady && !c.committed.empty() && !gated) {
    const int peer_rank = c.leader ? 1 : 0;
    wait_inputs(c);
    rt_->group_start();
    try {
      for (Part* p : c.committed) {
        for (auto& [buf, n] : p->sends) rt_->send(buf, n, peer_rank, c.comm, c.stream);
        for (auto& [buf, n] : p->recvs) rt_->recv(buf, n, peer_rank, c.comm, c.stream);
      }
    } catch (...) {
      rt_->group_end();
      throw;
    }
    rt_->group_end();
    for (Part* p : c.committed) {
      p->state = Part::kLaunched;
      c.launching.push_back(p);
    }
    c.committed.clear();
    moved = true;
    // A non-blocking communicator may still be launching the group.
    state = rt_->comm_state(c.comm, &why);
  }
  if (state != State::kPending && !c.launching.empty()) {
    // What was launched is on the stream now; after a failure too, so transfers that did run
    // before it are still seen done.
    on_stream(c);
    moved = true;
  }
  if (state == State::kFailed)
    throw_comm_error("fastcomm: rank " + std::to_string(rank_) + ": the channel to rank " + std::to_string(c.peer) +
                     " failed: " + why);
  return moved;
}

// The single-stream scheme: parts in issue order, no agreement, once the pair's communicator is up.
bool ChannelEngine::launch_single() {
  bool moved = false;
  while (!single_queue_.empty()) {
    Part* p = single_queue_.front();
    Channel& c = channel(p->peer);
    std::string why;
    if (c.comm == nullptr || rt_->comm_state(c.comm, &why) != State::kReady) break;
    single_queue_.pop_front();
    p->state = Part::kCommitted;
    c.committed.push_back(p);
    launch(c);
    moved = true;
  }
  return moved;
}

// The channel's current communicator goes (aborted, then released) and what was launched on it
// fails; what it still runs drains, and those parts' memory is held until it has (their events).
void ChannelEngine::drop_epoch(Channel& c, const std::exception_ptr& why) {
  if (c.comm != nullptr) {
    end_comm(c.comm, /*abort=*/true);
    c.comm = nullptr;
  }
  for (Comm r : c.retired) end_comm(r, /*abort=*/true);
  c.retired.clear();
  c.id_sent = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    failed_peers_.insert(c.peer);
  }
  std::vector<Part*> parts(c.committed.begin(), c.committed.end());
  if (!c.launching.empty() && c.stream != nullptr) {
    // Launched but not recorded: they are on the stream, so they get an event.
    try {
      EventPtr ev = events_->record(c.stream);
      for (Part* p : c.launching) {
        p->done_event = ev;
        p->stream = c.stream;
      }
    } catch (const std::exception&) {
    }
  }
  parts.insert(parts.end(), c.launching.begin(), c.launching.end());
  parts.insert(parts.end(), c.in_flight.begin(), c.in_flight.end());
  c.committed.clear();
  c.launching.clear();
  c.in_flight.clear();
  c.held.clear();  // the old epoch's commits: their parts fail here
  drop_slot(c);
  for (Part* p : parts) fail_part(p, why);
}

void ChannelEngine::reset(Channel& c, const std::string& why) {
  if (c.failed) return;
  if (single_) {
    fault(c, why);
    return;
  }
  std::vector<Key> launched;
  for (Part* p : c.committed) launched.push_back(p->op->key);
  for (Part* p : c.launching) launched.push_back(p->op->key);
  for (Part* p : c.in_flight) launched.push_back(p->op->key);
  c.reset_why = why;
  // A reset the channel was doomed to (not for good) is this one: a second would fail the
  // group's next op, made ready in the new epoch, on both sides.
  if (!c.doomed_for_good) c.doomed_why.clear();
  cancel_undecided(c, "this rank reset the channel to rank " + std::to_string(c.peer) + " (" + why + ")");
  drop_epoch(c, comm_error_ptr(why));
  PairAgreement::Out out;
  c.agree.reset(launched, out);
  try {
    apply(c, out);
  } catch (const std::exception& e) {
    doom(c, e.what());
  }
}

// Fails the pair's channel for good: its ops fail, naming the peer; other channels go on.
void ChannelEngine::fault(Channel& c, const std::string& why) {
  if (!c.failed)
    c.failed = comm_error_ptr(why.rfind("fastcomm:", 0) == 0
                                  ? why
                                  : "fastcomm: rank " + std::to_string(rank_) + ": the channel to rank " +
                                        std::to_string(c.peer) + " failed: " + why);
  std::exception_ptr e = c.failed;
  for (auto it = single_queue_.begin(); it != single_queue_.end();) {
    if ((*it)->peer == c.peer) {
      fail_part(*it, e);
      it = single_queue_.erase(it);
    } else {
      ++it;
    }
  }
  drop_epoch(c, e);
  // What the agreement holds fails too; the peer is not told (it is gone, or cannot be reached).
  PairAgreement::Out out;
  c.agree.reset({}, out);
  for (auto& fl : out.failed) fail_part(static_cast<Part*>(fl.token), e);
}

}  // namespace device
}  // namespace fastcomm
