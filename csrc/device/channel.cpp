// A pair's channel (device/channel_engine.h): the agreement frames, launches in agreed order,
// harvest of what ran, faults.
#include <algorithm>
#include <cstring>

#include "common/errors.h"
#include "device/channel_engine.h"

namespace fastcomm {
namespace device {

namespace {

std::exception_ptr comm_error_ptr(const std::string& msg) {
  try {
    throw_comm_error(msg);
  } catch (...) {
    return std::current_exception();
  }
}

}  // namespace

Channel& ChannelEngine::channel(int peer) {
  auto& c = channels_[peer];
  if (!c) {
    c = std::make_unique<Channel>();
    c->peer = peer;
    c->leader = rank_ < peer;
    c->stream = shared_;
  }
  return *c;
}

bool ChannelEngine::pump(Channel& c) {
  bool moved = false;
  if (c.doomed_why.empty()) {
    moved |= exchange(c);
    moved |= launch(c);
  }
  // Transfers seen done, in launch order (a channel's stream runs them in that order).
  while (!c.in_flight.empty()) {
    Part* p = c.in_flight.front();
    if (rt_->query(p->done_event->ev) != State::kReady) break;
    c.in_flight.pop_front();
    p->state = Part::kDone;
    part_done(p);
    moved = true;
  }
  if (!c.doomed_why.empty() && (c.in_flight.empty() || Clock::now() > c.doomed_at)) {
    fault(c, c.doomed_why);
    c.doomed_why.clear();
    moved = true;
  }
  return moved;
}

void ChannelEngine::doom(Channel& c, const std::string& why) {
  if (c.failed || !c.doomed_why.empty()) return;
  c.doomed_why = why;
  c.doomed_at = Clock::now() + std::chrono::milliseconds(100);
}

// The control messages of the pair: proposals out (leader), commits and mismatches out
// (follower), and whatever the peer sent in.
bool ChannelEngine::exchange(Channel& c) {
  bool moved = false;
  while (!c.tx.empty() && c.tx.front()->isCompleted()) {
    auto w = c.tx.front();
    c.tx.pop_front();
    if (auto e = w->exception()) std::rethrow_exception(e);
    moved = true;
  }
  if (single_ && c.leader && c.comm == nullptr && c.wants_comm) {
    c.id = rt_->new_id();
    c.comm = rt_->comm_init(c.id, 2, 0);
    send_frame(c, kPropose, {}, &c.id);
    c.id_sent = true;
  }
  if (c.leader && !c.to_propose.empty()) {
    if (c.comm == nullptr) {
      c.id = rt_->new_id();
      c.comm = rt_->comm_init(c.id, 2, 0);
      if (c.stream == nullptr) c.stream = rt_->new_stream();
    }
    std::vector<Entry> entries;
    for (Part* p : c.to_propose) {
      p->state = Part::kProposed;
      entries.push_back(Entry{p->op->key, p->sig});
    }
    c.to_propose.clear();
    send_frame(c, kPropose, entries, c.id_sent ? nullptr : &c.id);
    c.id_sent = true;
    moved = true;
  }
  // A receive is kept posted while anything here waits for the peer's word.
  auto needs_word = [&] {
    if (c.leader)
      return std::any_of(c.open.begin(), c.open.end(), [](const auto& kv) { return kv.second->state == Part::kProposed; });
    return !c.open.empty() || !c.awaiting.empty() || (c.comm == nullptr && c.wants_comm);
  };
  for (;;) {
    if (!c.rx) {
      if (!needs_word()) break;
      if (!c.rx_buf.defined()) c.rx_buf = at::empty({(int64_t)kFrameBytes}, at::kByte);
      c.rx = host_.control_recv(c.peer, c.rx_buf);
    }
    if (!c.rx->isCompleted()) break;
    auto w = std::move(c.rx);
    if (auto e = w->exception()) std::rethrow_exception(e);
    handle_frame(c, (const uint8_t*)c.rx_buf.data_ptr());
    moved = true;
  }
  if (!c.leader) {
    // Match the proposals to this rank's ready ops, in proposal order; one not issued here
    // yet waits without holding back those after it.
    for (auto it = c.proposals.begin(); it != c.proposals.end();) {
      auto f = c.open.find(it->key);
      if (f == c.open.end()) {
        ++it;
        continue;
      }
      Part* p = f->second;
      c.open.erase(f);
      if (compatible(it->sig, p->sig)) {
        p->state = Part::kCommitted;
        if (p->agree_only) c.awaiting[p->op->key] = p;
        else c.committed.push_back(p);
        c.commits.push_back(*it);
      } else {
        fail_op(p->op, comm_error_ptr("fastcomm: rank " + std::to_string(rank_) + ", group " + p->op->label +
                                      ": mismatched op: this rank issued " + sig_str(p->sig) + " where rank " +
                                      std::to_string(c.peer) + " issued " + sig_str(it->sig)));
        c.mismatches.push_back(Entry{it->key, p->sig});
        p->state = Part::kDone;
        part_launched(p);
        part_done(p);
      }
      it = c.proposals.erase(it);
      moved = true;
    }
    if (!c.commits.empty()) {
      send_frame(c, kCommit, c.commits, nullptr);
      c.commits.clear();
    }
    if (!c.mismatches.empty()) {
      send_frame(c, kMismatch, c.mismatches, nullptr);
      c.mismatches.clear();
    }
  }
  return moved;
}

void ChannelEngine::send_frame(Channel& c, FrameType type, const std::vector<Entry>& entries, const UniqueId* id) {
  for (size_t at = 0; at < entries.size() || (at == 0 && id != nullptr); at += kMaxEntries) {
    at::Tensor buf = at::empty({(int64_t)kFrameBytes}, at::kByte);
    auto* d = (uint8_t*)buf.data_ptr();
    FrameHead h;
    h.type = type;
    h.count = (uint32_t)std::min(kMaxEntries, entries.size() - at);
    h.has_id = id != nullptr && at == 0;
    std::memcpy(d, &h, sizeof(h));
    if (h.has_id) std::memcpy(d + sizeof(h), id, sizeof(UniqueId));
    else std::memset(d + sizeof(h), 0, sizeof(UniqueId));
    std::memcpy(d + sizeof(h) + sizeof(UniqueId), entries.data() + at, h.count * sizeof(Entry));
    c.tx.push_back(host_.control_send(c.peer, buf));
    if (entries.empty()) break;
  }
}

void ChannelEngine::handle_frame(Channel& c, const uint8_t* d) {
  FrameHead h;
  std::memcpy(&h, d, sizeof(h));
  TORCH_INTERNAL_ASSERT(h.count <= kMaxEntries && h.type >= kPropose && h.type <= kRefuse, "bad control frame");
  const auto* e = reinterpret_cast<const Entry*>(d + sizeof(h) + sizeof(UniqueId));
  if (h.type == kGo || h.type == kRefuse) {
    for (uint32_t i = 0; i < h.count; ++i) {
      Entry en;
      std::memcpy(&en, e + i, sizeof(en));
      auto f = c.awaiting.find(en.key);
      TORCH_INTERNAL_ASSERT(f != c.awaiting.end(), "rank ", c.peer, " decided on an op this rank did not commit");
      Part* p = f->second;
      GroupComm& g = *p->op->gc;
      if (h.has_id && g.comm == nullptr) {
        std::memcpy(&g.id, d + sizeof(h), sizeof(UniqueId));
        g.comm = rt_->comm_init(g.id, (int)g.ranks.size(), g.me);
        g.stream = rt_->new_stream();
      }
      c.awaiting.erase(f);
      if (h.type == kRefuse)
        fail_op(p->op, comm_error_ptr("fastcomm: rank " + std::to_string(rank_) + ", group " + p->op->label + ": " +
                                      op_kind_name(p->op->kind) + " refused by the group's rank 0 (rank " +
                                      std::to_string(c.peer) + "): another member issued a mismatched op"));
      p->state = Part::kDone;
      part_done(p);
    }
    return;
  }
  if (h.has_id) {
    TORCH_INTERNAL_ASSERT(h.type == kPropose && !c.leader && c.comm == nullptr,
                          "unexpected communicator id from rank ", c.peer);
    std::memcpy(&c.id, d + sizeof(h), sizeof(UniqueId));
    c.comm = rt_->comm_init(c.id, 2, 1);
    if (c.stream == nullptr) c.stream = rt_->new_stream();
  }
  for (uint32_t i = 0; i < h.count; ++i) {
    Entry en;
    std::memcpy(&en, e + i, sizeof(en));
    if (h.type == kPropose) {
      c.proposals.push_back(en);
      continue;
    }
    auto f = c.open.find(en.key);
    TORCH_INTERNAL_ASSERT(f != c.open.end(), "rank ", c.peer, " answered an op this rank did not propose");
    Part* p = f->second;
    c.open.erase(f);
    if (h.type == kCommit && p->agree_only) {
      p->agreed = true;
      p->state = Part::kDone;
      part_done(p);
    } else if (h.type == kCommit) {
      p->state = Part::kCommitted;
      c.committed.push_back(p);
    } else {
      fail_op(p->op, comm_error_ptr("fastcomm: rank " + std::to_string(rank_) + ", group " + p->op->label +
                                    ": mismatched op: this rank issued " + sig_str(p->sig) + " where rank " +
                                    std::to_string(c.peer) + " issued " + sig_str(en.sig)));
      p->state = Part::kDone;
      part_launched(p);
      part_done(p);
    }
  }
}

// Agreed parts go onto the pair's stream, in agreed order, as one group of sends and receives.
// Each waits first for its inputs (the caller's stream at issue) and for its group's previous
// op, both enqueued before it: a stream never waits on work enqueued after it.
bool ChannelEngine::launch(Channel& c) {
  if (c.comm == nullptr || (c.committed.empty() && c.launching.empty())) return false;
  std::string why;
  State state = rt_->comm_state(c.comm, &why);
  bool moved = false;
  if (state == State::kReady && !c.committed.empty()) {
    const int peer_rank = c.leader ? 1 : 0;
    Event last_input = nullptr, last_pred = nullptr;
    for (Part* p : c.committed) {
      DevOp* op = p->op;
      if (op->input->ev != last_input) rt_->wait(c.stream, last_input = op->input->ev);
      if (op->pred_end && op->pred_stream != c.stream && op->pred_end->ev != last_pred)
        rt_->wait(c.stream, last_pred = op->pred_end->ev);
    }
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
    EventPtr ev = events_->record(c.stream);
    for (Part* p : c.launching) {
      p->done_event = ev;
      p->stream = c.stream;
      c.in_flight.push_back(p);
      part_launched(p);
    }
    c.launching.clear();
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

// Aborts the pair's channel: its ops fail, naming the peer; other channels go on.
void ChannelEngine::fault(Channel& c, const std::string& why) {
  if (!c.failed)
    c.failed = comm_error_ptr(why.rfind("fastcomm:", 0) == 0
                                  ? why
                                  : "fastcomm: rank " + std::to_string(rank_) + ": the channel to rank " +
                                        std::to_string(c.peer) + " failed: " + why);
  if (c.comm != nullptr) {
    try {
      rt_->comm_abort(c.comm);
    } catch (const std::exception&) {
    }
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    failed_peers_.insert(c.peer);
  }
  std::vector<Part*> parts;
  for (auto& [k, p] : c.open) parts.push_back(p);
  for (auto& [k, p] : c.awaiting) parts.push_back(p);
  for (Part* p : c.committed) parts.push_back(p);
  for (Part* p : c.launching) parts.push_back(p);
  for (Part* p : c.in_flight) parts.push_back(p);
  for (auto it = single_queue_.begin(); it != single_queue_.end();) {
    if ((*it)->peer == c.peer) {
      parts.push_back(*it);
      it = single_queue_.erase(it);
    } else {
      ++it;
    }
  }
  // Launched but not recorded: they are on the stream (an abort drains it), so they get an event.
  if (!c.launching.empty() && c.stream != nullptr) {
    try {
      EventPtr ev = events_->record(c.stream);
      for (Part* p : c.launching) {
        p->done_event = ev;
        p->stream = c.stream;
      }
    } catch (const std::exception&) {
    }
  }
  c.open.clear();
  c.awaiting.clear();
  c.to_propose.clear();
  c.proposals.clear();
  c.committed.clear();
  c.launching.clear();
  c.in_flight.clear();
  for (Part* p : parts) {
    fail_op(p->op, c.failed);
    p->state = Part::kDone;
    part_launched(p);
    part_done(p);
  }
}

}  // namespace device
}  // namespace fastcomm
