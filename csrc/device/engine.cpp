// The device engine: ops on device tensors over per-peer channels (device/engine.h).
#include "device/engine.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "common/errors.h"
#include "device/ops.h"

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

// Completes the Futures of settled Works off the engine thread: a Future's callbacks run there
// and may wait for another device op, which only the engine thread can finish. A callback that
// blocks holds its own thread; the next Future gets a new one.
class Publisher {
 public:
  ~Publisher() { stop(); }
  void push(c10::intrusive_ptr<Work> w) {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(std::move(w));
    if (idle_ == 0) threads_.emplace_back([this] { loop(); });
    cv_.notify_one();
  }
  // Publishes what is queued, then joins the threads.
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      if (!queue_.empty()) {
        auto w = std::move(queue_.front());
        queue_.pop_front();
        lk.unlock();
        w->publish();
        w.reset();
        lk.lock();
        continue;
      }
      if (stop_) return;
      ++idle_;
      cv_.wait(lk);
      --idle_;
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<Work>> queue_;
  std::vector<std::thread> threads_;
  int idle_ = 0;
  bool stop_ = false;
};

// This rank's side of the pair with `peer`: a two-rank communicator on a stream of its own,
// made at the pair's first op. The lower rank leads: it proposes each op once it is ready; the
// other commits the proposals it has a matching ready op for, in whatever order they become
// ready, and both launch in commit order. So the channel's order is one both sides agreed on,
// and no op waits behind one its peer has not issued.
struct Channel {
  int peer = -1;
  bool leader = false;
  Comm comm = nullptr;
  bool id_sent = false;
  UniqueId id;
  Stream stream = nullptr;
  std::exception_ptr failed;  // set: the channel was aborted; every op on it fails
  // The peer looks gone (the host says so, a control message or the communicator failed):
  // transfers already done on the device are still harvested until `doomed_at`, then the
  // channel is aborted with `doomed_why`.
  std::string doomed_why;
  Clock::time_point doomed_at;
  std::unordered_map<Key, Part*, KeyHash> open;  // ready, not yet committed
  std::deque<Part*> to_propose;                  // leader: ready, not yet proposed
  std::deque<Entry> proposals;                   // follower: proposed, no matching ready op yet
  std::vector<Entry> commits, mismatches;        // follower: to tell the leader
  std::deque<Part*> committed;                   // agreed, not yet launched
  std::vector<Part*> launching;                  // launched; their event not yet recorded
  std::deque<Part*> in_flight;                   // launched and recorded, not yet seen done
  c10::intrusive_ptr<Work> rx;
  at::Tensor rx_buf;
  std::deque<c10::intrusive_ptr<Work>> tx;
  std::unordered_map<Key, Part*, KeyHash> awaiting;  // committed agreement parts: the leader's word
  bool wants_comm = false;  // single-stream scheme: parts wait for the communicator
  bool busy() const {
    return !open.empty() || !to_propose.empty() || !committed.empty() || !launching.empty() || !in_flight.empty() ||
           !awaiting.empty();
  }
};

// A large op of a group of three or more (FASTCOMM_RSAG_THRESHOLD bytes and up) runs as one
// NCCL collective on a communicator of the group's own, made at its first such op: no member
// moves (n - 1)x its data. The group's rank 0 proposes the op to every member over their pair
// channels; once all have committed it tells each to go (or, after a mismatch, refuses), so no
// member launches a collective another will not join. Ops of a group reach its communicator one
// at a time, in issue order (each waits for the previous one to be over).
struct GroupComm {
  std::vector<int> ranks;
  int me = 0;
  Comm comm = nullptr;
  Stream stream = nullptr;
  UniqueId id;
  bool id_sent = false;
  std::exception_ptr failed;
  std::string doomed_why;  // as Channel's: a member looks gone, collectives that ran are harvested first
  Clock::time_point doomed_at;
  std::deque<DevOp*> queued;  // agreed, waiting for the communicator
  DevOp* launching = nullptr;  // launched; its end not yet recorded (a non-blocking launch)
  std::deque<std::pair<DevOp*, EventPtr>> in_flight;
  bool busy() const { return !queued.empty() || launching != nullptr || !in_flight.empty(); }
};

// ---------------------------------------------------------------------------------------------

class ChannelEngine final : public DeviceEngine, public WorkOwner, public std::enable_shared_from_this<ChannelEngine> {
 public:
  ChannelEngine(const EngineOptions& opts, HostLink& host, std::unique_ptr<Runtime> rt)
      : rank_(opts.rank),
        single_(opts.settings.device_single_stream),
        host_(host),
        rt_(std::move(rt)),
        group_comm_bytes_(opts.settings.rsag_threshold) {
    join_ = rt_->new_stream();
    if (single_) shared_ = rt_->new_stream();
    thread_ = std::thread([this] { main(); });
  }
  ~ChannelEngine() override { shutdown(); }

  c10::intrusive_ptr<Work> post(std::vector<DeviceOp> ops, bool async_op, bool rethrow) override;
  void shutdown() override;

  // WorkOwner
  Runtime& runtime() override { return *rt_; }
  std::exception_ptr broken() const override {
    std::lock_guard<std::mutex> lk(mu_);
    return broken_;
  }
  void wait(Work& w, std::chrono::milliseconds timeout) override { wait_until(w, false, timeout); }
  void wait_end(Work& w, std::chrono::milliseconds timeout) override { wait_until(w, true, timeout); }
  void poll() override {}

 private:
  void wait_until(Work& w, bool end_enough, std::chrono::milliseconds timeout);

  // The engine thread: every runtime call on communicators and channel streams happens here,
  // so an abort never races another call on the same communicator.
  void main();
  bool pass();
  void admit(std::unique_ptr<DevOp> op);
  void make_ready(DevOp* op);
  Channel& channel(int peer);
  bool pump(Channel& c);
  bool exchange(Channel& c);
  void handle_frame(Channel& c, const uint8_t* data);
  // `id`: a communicator id the frame carries (the pair's, or with kGo the group's), or null.
  void send_frame(Channel& c, FrameType type, const std::vector<Entry>& entries, const UniqueId* id);
  bool launch(Channel& c);
  void part_done(Part* p);
  void finish(DevOp* op);
  void fail_op(DevOp* op, std::exception_ptr e);
  void fault(Channel& c, const std::string& why);
  void doom(Channel& c, const std::string& why);
  bool check_health();
  void settle(Batch& b, std::exception_ptr e);
  void agreed(DevOp* op);
  bool pump_group(GroupComm& g);
  void fault_group(GroupComm& g, const std::string& why);
  void teardown();

  const int rank_;
  // The scheme this engine replaced, kept to show the fake runtime is faithful (tests): every
  // channel on one stream, parts launched in issue order with no agreement.
  const bool single_;
  Stream shared_ = nullptr;
  std::deque<Part*> single_queue_;  // its parts in issue order, launched strictly in that order
  HostLink& host_;
  std::unique_ptr<Runtime> rt_;
  Stream join_ = nullptr;  // end work (folds, local copies) of ops whose transfers are over

  mutable std::mutex mu_;  // guards the fields up to the thread's own state below
  std::condition_variable cv_;       // wakes the engine thread
  std::condition_variable done_cv_;  // wakes waiters
  std::vector<std::unique_ptr<DevOp>> incoming_;
  std::unordered_map<uint64_t, uint64_t> next_seq_;
  std::exception_ptr broken_;
  bool stop_ = false;
  std::thread thread_;

  // The engine thread's own state.
  std::unordered_map<uint64_t, DevOp*> tail_;  // last op of each group id
  std::vector<std::unique_ptr<DevOp>> live_;
  std::unordered_map<int, std::unique_ptr<Channel>> channels_;
  std::unordered_map<uint64_t, std::unique_ptr<GroupComm>> groups_;
  std::vector<Channel*> pass_channels_;  // pass()'s snapshots, kept to reuse their memory
  std::vector<GroupComm*> pass_groups_;
  const size_t group_comm_bytes_;
  std::deque<std::shared_ptr<Batch>> ending_;  // end event recorded, not yet seen done
  // The end of the last finished op of each group id, while it may not have run: the group's
  // next op waits for it even when the op itself is gone.
  std::unordered_map<uint64_t, EventPtr> last_end_;
  Publisher publisher_;
  Clock::time_point last_health_ = Clock::now();
};

// ---------------------------------------------------------------------------------------------
// Issue (caller's thread)

c10::intrusive_ptr<Work> ChannelEngine::post(std::vector<DeviceOp> dops, bool async_op, bool rethrow) {
  const Stream caller = rt_->current_stream();
  TORCH_CHECK(!rt_->capturing(caller), "fastcomm: rank ", rank_,
              ": device ops cannot be captured in a CUDA graph (their transfers are scheduled by the host)");
  auto batch = std::make_shared<Batch>();
  std::vector<std::unique_ptr<DevOp>> ops;
  std::vector<at::Tensor> outputs;
  c10d::OpType type = dops.size() == 1 ? op_kind_type(dops[0].req.kind) : c10d::OpType::COALESCED;
  for (auto& d : dops) {
    ops.push_back(lower(d, batch, Lowering{*rt_, join_, rank_, !single_, group_comm_bytes_}));
    const OpRequest& r = d.req;
    if (r.kind == OpKind::kAllGather) outputs.insert(outputs.end(), r.list.begin(), r.list.end());
    else outputs.push_back(r.output.defined() ? r.output : r.tensor);
  }
  // The transfers start where the caller's stream is now: the inputs are ready there.
  auto input = std::make_shared<EventRef>(*rt_, rt_->new_event());
  rt_->record(input->ev, caller);
  batch->work = c10::make_intrusive<DeviceWork>(shared_from_this(), rank_, type, std::move(outputs), 1, async_op);
  batch->left = (int)ops.size();
  const auto now = Clock::now();
  auto work = batch->work;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) std::rethrow_exception(broken_);
    for (size_t i = 0; i < ops.size(); ++i) {
      DevOp& op = *ops[i];
      op.key = Key{dops[i].id, next_seq_[dops[i].id]++};
      op.input = input;
      op.deadline = now + op.timeout;
      incoming_.push_back(std::move(ops[i]));
    }
    if (ops.empty()) work->settle(nullptr, true);
  }
  cv_.notify_all();
  if (!async_op && rethrow) {
    wait_until(*work, false, std::chrono::milliseconds(0));
    work->rethrow_if_failed();
  }
  return work;
}

void ChannelEngine::wait_until(Work& w, bool end_enough, std::chrono::milliseconds timeout) {
  auto ready = [&] { return w.done() || (end_enough && static_cast<DeviceWork&>(w).end() != nullptr); };
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout.count() <= 0) {
    done_cv_.wait(lk, ready);
  } else if (!done_cv_.wait_for(lk, timeout, ready)) {
    throw_comm_error("fastcomm: rank " + std::to_string(rank_) + ": device op not finished after " +
                     std::to_string(timeout.count()) + " ms (wait timed out)");
  }
}

void ChannelEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;
    stop_ = true;
    if (!broken_) broken_ = comm_error_ptr("fastcomm: rank " + std::to_string(rank_) + ": fastcomm was shut down");
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

// ---------------------------------------------------------------------------------------------
// The engine thread

void ChannelEngine::main() {
  std::unique_lock<std::mutex> lk(mu_);
  int idle = 0;
  while (!stop_) {
    std::vector<std::unique_ptr<DevOp>> in;
    in.swap(incoming_);
    lk.unlock();
    bool moved = false;
    try {
      for (auto& op : in) admit(std::move(op));
      moved = pass();
    } catch (const std::exception& e) {
      // A runtime call failed outside any one channel (the join stream, an event): nothing
      // can be trusted any more.
      std::lock_guard<std::mutex> g(mu_);
      if (!broken_) broken_ = comm_error_ptr(std::string("fastcomm: rank ") + std::to_string(rank_) +
                                             ": the device engine failed: " + e.what());
      stop_ = true;
    }
    lk.lock();
    if (moved || !incoming_.empty()) {
      idle = 0;
      continue;
    }
    // Control messages and device events do not wake this thread: poll, backing off while
    // nothing moves.
    if (live_.empty() && ending_.empty()) {
      cv_.wait(lk, [&] { return stop_ || !incoming_.empty(); });
    } else {
      idle = std::min(idle + 1, 50);
      cv_.wait_for(lk, std::chrono::microseconds(idle < 20 ? 5 * idle : 200),
                   [&] { return stop_ || !incoming_.empty(); });
    }
  }
  lk.unlock();
  teardown();
}

void ChannelEngine::admit(std::unique_ptr<DevOp> op) {
  DevOp* o = op.get();
  live_.push_back(std::move(op));  // first: whatever throws below, teardown still fails it
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
  if (single_ || pred == nullptr || pred->finished) {
    if (pred != nullptr) {
      o->pred_end = pred->end;
    } else {
      auto e = last_end_.find(o->key.id);
      if (e != last_end_.end()) o->pred_end = e->second;
    }
    make_ready(o);
  } else {
    pred->next = o;
  }
}

// The op's inputs are ready on the host's side: its parts may be agreed with the peers.
void ChannelEngine::make_ready(DevOp* op) {
  op->ready = true;
  if (op->gc != nullptr && op->gc->failed) {
    // Agreed all the same, so that no member waits for an answer: the flag makes the other
    // side refuse it.
    fail_op(op, op->gc->failed);
    for (auto& p : op->parts) p->sig.flags |= kGroupBroken;
  }
  if (op->parts.empty()) {
    finish(op);
    return;
  }
  for (auto& up : op->parts) {
    Part* p = up.get();
    Channel& c = channel(p->peer);
    if (c.failed) {
      fail_op(op, c.failed);
      p->state = Part::kDone;
      part_done(p);
      continue;
    }
    if (single_) {
      c.wants_comm = true;
      single_queue_.push_back(p);
      continue;
    }
    c.open[op->key] = p;
    if (c.leader) c.to_propose.push_back(p);
  }
}

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

bool ChannelEngine::pass() {
  bool moved = false;
  // Finishing an op may make the next one of its group ready and so make a channel: walk a
  // snapshot (channels are never removed before teardown).
  std::vector<Channel*>& chans = pass_channels_;
  chans.clear();
  for (auto& [peer, c] : channels_) chans.push_back(c.get());
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
  for (Channel* c : chans) {
    try {
      moved |= pump(*c);
    } catch (const std::exception& e) {
      doom(*c, e.what());
      moved = true;
    }
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
  }
  // Ops whose batch has its end event: settle once it has run.
  while (!ending_.empty()) {
    Batch& b = *ending_.front();
    if (rt_->query(b.end->ev) != State::kReady) break;
    settle(b, b.error);
    ending_.pop_front();
    moved = true;
  }
  moved |= check_health();
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
      c.rx_buf = at::empty({(int64_t)kFrameBytes}, at::kByte);
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
    at::Tensor buf = at::zeros({(int64_t)kFrameBytes}, at::kByte);
    auto* d = (uint8_t*)buf.data_ptr();
    FrameHead h;
    h.type = type;
    h.count = (uint32_t)std::min(kMaxEntries, entries.size() - at);
    h.has_id = id != nullptr && at == 0;
    std::memcpy(d, &h, sizeof(h));
    if (h.has_id) std::memcpy(d + sizeof(h), id, sizeof(UniqueId));
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
      part_done(p);
    }
  }
}

// Agreed parts go onto the pair's stream, in agreed order, as one group of sends and receives.
bool ChannelEngine::launch(Channel& c) {
  if (c.comm == nullptr || (c.committed.empty() && c.launching.empty())) return false;
  std::string why;
  State state = rt_->comm_state(c.comm, &why);
  bool moved = false;
  if (state == State::kReady && !c.committed.empty()) {
    const int peer_rank = c.leader ? 1 : 0;
    for (Part* p : c.committed) {
      rt_->wait(c.stream, p->op->input->ev);
      if (p->op->pred_end) rt_->wait(c.stream, p->op->pred_end->ev);
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
    auto ev = std::make_shared<EventRef>(*rt_, rt_->new_event());
    rt_->record(ev->ev, c.stream);
    for (Part* p : c.launching) {
      p->done_event = ev;
      c.in_flight.push_back(p);
    }
    c.launching.clear();
    moved = true;
  }
  if (state == State::kFailed)
    throw_comm_error("fastcomm: rank " + std::to_string(rank_) + ": the channel to rank " + std::to_string(c.peer) +
                     " failed: " + why);
  return moved;
}

void ChannelEngine::part_done(Part* p) {
  DevOp* op = p->op;
  if (--op->parts_left > 0) return;
  if (op->gc != nullptr) agreed(op);
  else finish(op);
}

// Every agreement part of a group-communicator op has its answer.
void ChannelEngine::agreed(DevOp* op) {
  GroupComm& g = *op->gc;
  if (op->leads) {
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
        g.id = rt_->new_id();
        g.comm = rt_->comm_init(g.id, (int)g.ranks.size(), 0);
        g.stream = rt_->new_stream();
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
    finish(op);
    return;
  }
  g.queued.push_back(op);
}

void ChannelEngine::fail_op(DevOp* op, std::exception_ptr e) {
  if (!op->error) op->error = e;
}

// The op's transfers are over (or it failed): its end work goes onto the join stream, and the
// next op of its group may start.
void ChannelEngine::finish(DevOp* op) {
  if (op->finished) return;
  if (!op->error && (!op->folds.empty() || !op->copies.empty())) {
    rt_->wait(join_, op->input->ev);
    for (auto& [dst, src, n] : op->copies) rt_->copy(dst, src, n, join_);
    if (!op->folds.empty()) rt_->fold(op->folds.data(), (int)op->folds.size(), join_);
    op->end = std::make_shared<EventRef>(*rt_, rt_->new_event());
    rt_->record(op->end->ev, join_);
    op->batch->device_work = true;
    Batch& b = *op->batch;
    b.keep.insert(b.keep.end(), op->keep.begin(), op->keep.end());
    if (op->scratch.defined()) b.keep.push_back(op->scratch);
  } else {
    op->end = op->pred_end;  // what the group's next op must wait for is still the previous end
  }
  op->finished = true;
  if (op->end) last_end_[op->key.id] = op->end;
  else last_end_.erase(op->key.id);
  Batch& b = *op->batch;
  if (op->error && !b.error) b.error = op->error;
  if (--b.left == 0) {
    if (!b.device_work) {
      settle(b, b.error);
    } else {
      // Settled once the end work has run, failed or not: until then it uses b.keep.
      b.end = std::make_shared<EventRef>(*rt_, rt_->new_event());
      rt_->record(b.end->ev, join_);
      if (!b.error) {
        Event e = rt_->new_event();
        rt_->record(e, join_);
        {
          std::lock_guard<std::mutex> lk(mu_);
          b.work->set_end(e);
        }
        done_cv_.notify_all();
      }
      ending_.push_back(op->batch);
    }
  }
  if (op->next != nullptr) {
    DevOp* n = op->next;
    op->next = nullptr;
    n->pred_end = op->end;
    make_ready(n);
  }
}

void ChannelEngine::settle(Batch& b, std::exception_ptr e) {
  bool fin, has_future = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    fin = b.work->settle(e, true, &has_future);
  }
  done_cv_.notify_all();
  if (fin && has_future) publisher_.push(b.work);
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
    part_done(p);
  }
}

bool ChannelEngine::pump_group(GroupComm& g) {
  bool moved = false;
  while (!g.in_flight.empty() && rt_->query(g.in_flight.front().second->ev) == State::kReady) {
    DevOp* op = g.in_flight.front().first;
    g.in_flight.pop_front();
    finish(op);
    moved = true;
  }
  if (!g.doomed_why.empty()) {
    if (g.in_flight.empty() || Clock::now() > g.doomed_at) {
      fault_group(g, g.doomed_why);
      return true;
    }
    return moved;
  }
  if (g.comm == nullptr || (g.queued.empty() && g.launching == nullptr && g.in_flight.empty())) return moved;
  std::string why;
  State state = rt_->comm_state(g.comm, &why);
  if (state == State::kReady && g.launching == nullptr && !g.queued.empty()) {
    DevOp* op = g.queued.front();
    rt_->wait(g.stream, op->input->ev);
    if (op->pred_end) rt_->wait(g.stream, op->pred_end->ev);
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
    // The op's memory stays allocated until the stream has run its work on it: after an abort
    // the op settles at once, while the stream may still hold the end of an AVG.
    for (const at::Tensor& t : op->keep) rt_->keep(t, g.stream);
    g.queued.pop_front();
    g.launching = op;
    moved = true;
    state = rt_->comm_state(g.comm, &why);
  }
  if (state != State::kPending && g.launching != nullptr) {
    auto ev = std::make_shared<EventRef>(*rt_, rt_->new_event());
    rt_->record(ev->ev, g.stream);
    g.in_flight.emplace_back(g.launching, ev);
    g.launching = nullptr;
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
  if (g.comm != nullptr) {
    try {
      rt_->comm_abort(g.comm);
    } catch (const std::exception&) {
    }
  }
  std::vector<DevOp*> ops(g.queued.begin(), g.queued.end());
  if (g.launching) ops.push_back(g.launching);
  for (auto& [op, ev] : g.in_flight) ops.push_back(op);
  g.queued.clear();
  g.launching = nullptr;
  g.in_flight.clear();
  for (DevOp* op : ops) {
    fail_op(op, g.failed);
    finish(op);
  }
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
      if (p->state == Part::kDone) continue;
      Channel& c = channel(p->peer);
      fault(c, "fastcomm: rank " + std::to_string(rank_) + ", group " + op->label + ": " + op_kind_name(op->kind) +
                   " did not finish within the group's timeout (" + std::to_string(op->timeout.count()) +
                   " ms) waiting for rank " + std::to_string(p->peer) + "; the channel to rank " +
                   std::to_string(p->peer) + " was aborted");
      moved = true;
    }
  }
  if (now - last_health_ < std::chrono::milliseconds(50)) return moved;
  last_health_ = now;
  for (auto it = last_end_.begin(); it != last_end_.end();) {
    if (rt_->query(it->second->ev) == State::kReady) it = last_end_.erase(it);
    else ++it;
  }
  for (auto& [id, g] : groups_) {
    if (g->failed || !g->busy()) continue;
    for (int r : g->ranks) {
      if (r == rank_ || host_.peer_alive(r)) continue;
      if (g->doomed_why.empty()) {
        g->doomed_why = "fastcomm: rank " + std::to_string(rank_) + ": peer rank " + std::to_string(r) +
                        " exited; the communicator of its group was aborted";
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
    if (c->failed || !c->busy()) continue;
    if (!host_.peer_alive(peer)) {
      doom(*c, "fastcomm: rank " + std::to_string(rank_) + ": peer rank " + std::to_string(peer) +
                   " exited; its channel was aborted");
      moved = true;
    }
  }
  return moved;
}

void ChannelEngine::teardown() {
  std::exception_ptr why = broken();
  // Ops posted before the engine stopped, not yet taken in: they fail with the rest.
  std::vector<std::unique_ptr<DevOp>> in;
  {
    std::lock_guard<std::mutex> lk(mu_);
    in.swap(incoming_);
  }
  for (auto& op : in) {
    DevOp* o = op.get();
    live_.push_back(std::move(op));
    fail_op(o, why);
  }
  // Ops still open may wait on a peer for good: their channels are aborted, so every stream
  // drains, and their Works fail.
  const std::string down = "fastcomm: rank " + std::to_string(rank_) + ": fastcomm was shut down";
  std::vector<Channel*> chans;
  for (auto& [peer, c] : channels_) chans.push_back(c.get());
  for (Channel* c : chans)
    if (c->busy()) fault(*c, down);
  for (auto& [id, g] : groups_)
    if (g->busy()) fault_group(*g, down);
  for (auto& op : live_) {
    if (!op->finished) {
      fail_op(op.get(), why);
      finish(op.get());
    }
  }
  for (auto& b : ending_) {
    // Its end work is local (folds, copies): it runs; wait so its memory outlives it.
    try {
      rt_->synchronize(b->end->ev);
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
    try {
      if (c->comm != nullptr) rt_->comm_destroy(c->comm);
      if (c->stream != nullptr && c->stream != shared_) rt_->destroy_stream(c->stream);
    } catch (const std::exception&) {
    }
  }
  channels_.clear();
  for (auto& [id, g] : groups_) {
    try {
      if (g->comm != nullptr) rt_->comm_destroy(g->comm);
      if (g->stream != nullptr) rt_->destroy_stream(g->stream);
    } catch (const std::exception&) {
    }
  }
  groups_.clear();
  try {
    if (shared_ != nullptr) rt_->destroy_stream(shared_);
    rt_->destroy_stream(join_);
  } catch (const std::exception&) {
  }
}

}  // namespace device

std::shared_ptr<DeviceEngine> make_device_engine(const EngineOptions& opts, HostLink& host,
                                                 std::unique_ptr<device::Runtime> runtime) {
  return std::make_shared<device::ChannelEngine>(opts, host, std::move(runtime));
}

}  // namespace fastcomm
