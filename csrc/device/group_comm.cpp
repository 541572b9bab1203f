// Large ops of groups of 3+ on the group's own communicator (device/channel_engine.h, GroupComm).
#include <algorithm>

#include "common/errors.h"
#include "device/channel_engine.h"

namespace fastcomm {
namespace device {

Comm ChannelEngine::new_group_comm(GroupComm& g, const UniqueId& id) {
  g.id = id;
  g.comm = rt_->comm_init(id, (int)g.ranks.size(), g.me);
  if (g.stream == nullptr) g.stream = rt_->new_stream();
  ++group_comms_;
  return g.comm;
}

void ChannelEngine::end_group_comm(GroupComm& g, bool abort) {
  Comm comm = g.comm;
  g.comm = nullptr;
  g.id_sent = false;
  if (comm == nullptr) return;
  --group_comms_;
  retire_comm(comm, abort);
}

void ChannelEngine::release_idle_groups(Clock::time_point now) {
  for (auto& [id, g] : groups_) {
    if (g->me != 0 || g->comm == nullptr || g->failed || g->busy() || !g->doomed_why.empty()) continue;
    if (now - g->last_used < idle_release_) continue;
    end_group_comm(*g, /*abort=*/false);
    for (size_t i = 1; i < g->ranks.size(); ++i) {
      Channel& c = channel(g->ranks[i]);
      if (c.failed) continue;
      try {
        send_frame(c, kGroupRelease, {Entry{Key{id, 0}, Sig{}}}, nullptr);
      } catch (const std::exception& e) {
        doom(c, e.what());
      }
    }
  }
}

bool ChannelEngine::propose_in_turn(DevOp* op) {
  if (!op->leads || op->gc == nullptr || !group_slots() || op->parts.size() < 2) return false;
  for (auto& p : op->parts) p->held_back = true;
  op->chain = (int)op->parts.size() - 1;
  ready_part(op->parts.back().get());  // the highest member first
  return true;
}

// Every agreement part of a group-communicator op has its answer.
void ChannelEngine::agreed(DevOp* op) {
  GroupComm& g = *op->gc;
  if (op->awaits_go) {
    op->awaits_go = false;
    --g.awaiting;
    // A commit still held (its op failed meanwhile) never goes out.
    g.held.erase(std::remove_if(g.held.begin(), g.held.end(), [&](const auto& h) { return h.first.key == op->key; }),
                 g.held.end());
  }
  if (op->leads && !op->error && !g.failed && group_slots()) {
    // The kernel bound: every member holds a slot for the op now (each committed holding one);
    // the go goes out once rank 0 holds one too, so a launched collective meets every other
    // member's launched, or about to be (group_slot()).
    g.to_go.push_back(op);
    if (take_slot(g)) group_slot(g);
    return;
  }
  decide(op);
}

void ChannelEngine::cancel_undecided(Channel& c, const std::string& why) {
  for (auto& op : live_) {
    if (!op->leads || op->gc == nullptr || op->decided || op->error) continue;
    for (auto& p : op->parts)
      if (p->peer == c.peer && p->agreed) {
        fail_op(op.get(), comm_error_ptr("fastcomm: rank " + std::to_string(rank_) + ", group " + op->label + ": " +
                                         op_kind_name(op->kind) + " cancelled before the go: rank " + std::to_string(c.peer) +
                                         " had answered, and then " + why + ", which dropped its side"));
        break;
      }
  }
}

void ChannelEngine::decide(DevOp* op) {
  GroupComm& g = *op->gc;
  if (op->leads) {
    op->decided = true;
    // The leader's word to every member that committed; the first op carries the id.
    bool go = !op->error && !g.failed;
    for (auto& p : op->parts) {
      const Channel& c = channel(p->peer);
      if (c.failed || !c.doomed_why.empty()) go = false;  // a member that cannot be told to go
    }
    if (!op->error && !go) {
      fail_op(op, comm_error_ptr("fastcomm: rank " + std::to_string(rank_) + ", group " + op->label + ": " +
                                 op_kind_name(op->kind) + " refused: a member's channel failed"));
    }
    if (go && g.comm == nullptr) {
      try {
        new_group_comm(g, rt_->new_id());
      } catch (const std::exception& e) {
        fault_group(g, e.what());
        go = false;
      }
    }
    for (auto& p : op->parts) {
      if (!p->agreed) continue;
      Channel& c = channel(p->peer);
      if (c.failed) continue;
      try {
        send_frame(c, go ? kGo : kRefuse, {Entry{op->key, p->sig}}, go && !g.id_sent ? &g.id : nullptr);
      } catch (const std::exception& ex) {
        doom(c, ex.what());
      }
    }
    if (go) g.id_sent = true;
  }
  if (op->error || g.failed) {
    if (!op->error) fail_op(op, g.failed);
    abandon(op);
    return;
  }
  g.queued.push_back(op);
}

bool ChannelEngine::hold_group_commits(Frame& f) {
  std::vector<GroupComm*> touched;
  auto rest = f.entries.begin();
  for (Entry& e : f.entries) {
    auto it = (e.sig.flags & kOnGroupComm) ? groups_.find(e.key.id) : groups_.end();
    if (it == groups_.end()) {
      *rest++ = e;
      continue;
    }
    GroupComm& g = *it->second;
    g.held.emplace_back(e, f.epoch);
    if (std::find(touched.begin(), touched.end(), &g) == touched.end()) touched.push_back(&g);
  }
  f.entries.erase(rest, f.entries.end());
  for (GroupComm* g : touched) {
    // A failed group launches nothing: its commits go at once (rank 0 is then refused, or
    // times out, as without the bound).
    if (g->failed || take_slot(*g)) send_group_held(*g);
  }
  return f.entries.empty();
}

// Held commits go to rank 0, those of the channel's current epoch (an older one's item failed
// in the reset that ended it, on both sides).
void ChannelEngine::send_group_held(GroupComm& g) {
  if (g.held.empty()) return;
  Channel& c = channel(g.ranks[0]);
  std::vector<Entry> now;
  for (auto& [e, epoch] : g.held)
    if (epoch == c.agree.epoch()) now.push_back(e);
  g.held.clear();
  if (now.empty() || c.failed) return;
  const UniqueId* id = nullptr;
  if (!c.id_sent && ipc_->find(c.comm) != nullptr) {
    id = &c.id;  // the follower's ring rides on its first answer (apply())
    c.id_sent = true;
  }
  try {
    send_frame(c, kCommit, now, id);
  } catch (const std::exception& e) {
    doom(c, e.what());
  }
}

bool ChannelEngine::group_slot(GroupComm& g) {
  if (!g.slot) return false;
  bool moved = false;
  if (!g.held.empty()) {
    send_group_held(g);
    moved = true;
  }
  while (!g.to_go.empty()) {
    DevOp* op = g.to_go.front();
    g.to_go.pop_front();
    decide(op);
    moved = true;
  }
  if (g.held.empty() && g.awaiting == 0 && g.to_go.empty() && g.queued.empty() && g.launching == nullptr &&
      g.in_flight.empty()) {
    drop_slot(g);
    moved = true;
  }
  return moved;
}

// Launches the group's agreed ops in order, each waiting for its inputs and the group's previous
// op (enqueued before it), and harvests those that ran.
bool ChannelEngine::pump_group(GroupComm& g) {
  bool moved = false;
  while (!g.in_flight.empty() && rt_->query(g.in_flight.front().second->ev) == State::kReady) {
    DevOp* op = g.in_flight.front().first;
    g.in_flight.pop_front();
    op_finished(op);
    g.last_used = Clock::now();
    moved = true;
  }
  moved |= group_slot(g);
  if (!g.doomed_why.empty()) {
    if (g.in_flight.empty() || Clock::now() > g.doomed_at) {
      fault_group(g, g.doomed_why);
      return true;
    }
    return moved;
  }
  if (g.in_flight.empty() && g.launching == nullptr) {
    // Member: the leader released the communicator, or its kGo brought a new one.
    if (g.release_pending || g.has_next) {
      g.release_pending = false;
      end_group_comm(g, /*abort=*/false);
    }
    if (g.has_next) {
      g.has_next = false;
      new_group_comm(g, g.next_id);
    }
  }
  // A communicator this member was told to drop (released, or replaced by the go's) takes no
  // further op: the leader runs them on the next one, which waits for this member's in flight.
  if ((g.release_pending || g.has_next) && g.launching == nullptr) return moved;
  if (g.comm == nullptr || (g.queued.empty() && g.launching == nullptr)) return moved;
  std::string why;
  State state = rt_->comm_state(g.comm, &why);
  while (state == State::kReady && g.launching == nullptr && !g.queued.empty()) {
    DevOp* op = g.queued.front();
    rt_->wait(g.stream, op->input->ev);
    if (op->pred_end && op->pred_stream != g.stream) rt_->wait(g.stream, op->pred_end->ev);
    const Collective& c = op->coll;
    switch (c.kind) {
      case OpKind::kAllReduce:
        rt_->all_reduce(c.in, c.out, c.count, c.dtype, c.op, g.comm, g.stream);
        break;
      case OpKind::kReduceScatterTensor:
        rt_->reduce_scatter(c.in, c.out, c.count, c.dtype, c.op, g.comm, g.stream);
        break;
      case OpKind::kAllGatherIntoTensor:
        rt_->all_gather(c.in, c.out, (size_t)c.count, g.comm, g.stream);
        break;
      default:
        rt_->broadcast(c.in, (size_t)c.count, c.root, g.comm, g.stream);
        break;
    }
    g.queued.pop_front();
    g.launching = op;
    g.last_used = Clock::now();
    moved = true;
    state = rt_->comm_state(g.comm, &why);
    if (state != State::kPending) {
      EventPtr ev = events_->record(g.stream);
      g.in_flight.emplace_back(op, ev);
      g.launching = nullptr;
      ended(op, g.stream, ev);
    }
  }
  if (state != State::kPending && g.launching != nullptr) {
    DevOp* op = g.launching;
    EventPtr ev = events_->record(g.stream);
    g.in_flight.emplace_back(op, ev);
    g.launching = nullptr;
    ended(op, g.stream, ev);
    moved = true;
  }
  if (state == State::kFailed) {
    g.doomed_why = why;
    g.doomed_at = Clock::now() + std::chrono::milliseconds(100);
    return true;
  }
  return moved;
}

// Aborts a group's communicator: its ops fail; the group's later large ops fail at once.
void ChannelEngine::fault_group(GroupComm& g, const std::string& why) {
  if (!g.failed) {
    std::string label = "[";
    for (size_t i = 0; i < g.ranks.size(); ++i) label += (i ? ", " : "") + std::to_string(g.ranks[i]);
    label += "]";
    g.failed = comm_error_ptr(why.rfind("fastcomm:", 0) == 0
                                  ? why
                                  : "fastcomm: rank " + std::to_string(rank_) + ", group " + label +
                                        ": the group's communicator failed: " + why);
  }
  if (g.comm != nullptr) end_group_comm(g, /*abort=*/true);
  std::vector<DevOp*> ops(g.queued.begin(), g.queued.end());
  if (g.launching) {
    // On the stream (the abort drains it): its memory is held until the stream passes it.
    DevOp* op = g.launching;
    try {
      EventPtr ev = events_->record(g.stream);
      ended(op, g.stream, ev);
    } catch (const std::exception&) {
    }
    ops.push_back(op);
  }
  for (auto& [op, ev] : g.in_flight) ops.push_back(op);
  g.queued.clear();
  g.launching = nullptr;
  g.in_flight.clear();
  for (DevOp* op : ops) {
    fail_op(op, g.failed);
    abandon(op);
  }
  // What waited for the slot: rank 0 refuses its agreed op; a member's commits go (rank 0 then
  // hears of the failure only by its own timeout, as without the bound).
  send_group_held(g);
  while (!g.to_go.empty()) {
    DevOp* op = g.to_go.front();
    g.to_go.pop_front();
    fail_op(op, g.failed);
    decide(op);
  }
  drop_slot(g);
}

}  // namespace device
}  // namespace fastcomm
