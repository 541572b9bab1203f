// The device engine: issue, the engine thread and an op's life (device/engine.h,
// device/channel_engine.h).
#include <algorithm>
#include <cstring>

#include "common/errors.h"
#include "device/channel_engine.h"
#include "device/graph.h"

namespace fastcomm {
namespace device {

namespace {

// Passes the engine thread yields between before it sleeps while ops are live.
constexpr int kYieldPasses = 200;


std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

ChannelEngine::ChannelEngine(const EngineOptions& opts, HostLink& host, std::unique_ptr<Runtime> rt)
    : rank_(opts.rank),
      single_(opts.settings.device_single_stream),
      host_(host),
      rt_(std::move(rt)),
      ipc_on_(!single_ && rt_->ipc_supported() &&
              (opts.settings.device_ipc == 1 || (opts.settings.device_ipc < 0 && std::string(rt_->name()) != "fake"))),
      ipc_ring_bytes_(opts.settings.device_ipc_ring_bytes),
      ipc_group_max_(opts.settings.device_ipc_group_max),
      host_of_(opts.host_of),
      idle_release_(opts.settings.device_idle_ms),
      max_comms_((size_t)opts.settings.device_max_comms),
      max_kernels_(opts.settings.device_max_kernels),
      group_comm_bytes_(opts.settings.rsag_threshold) {
  events_ = std::make_shared<EventPool>(*rt_);
  ipc_ = std::make_unique<IpcLinks>(*rt_);
  alloc_ = rt_->new_stream();
  if (single_) shared_ = rt_->new_stream();
  thread_ = std::thread([this] { main(); });
}

// ---------------------------------------------------------------------------------------------
// Issue (caller's thread)

c10::intrusive_ptr<Work> ChannelEngine::post(std::vector<DeviceOp> dops, bool async_op, bool rethrow) {
  const Stream caller = rt_->current_stream();
  if (rt_->capturing(caller)) throw_capture_refusal(dops);
  {
    // An error of a group's earlier blocking op that came after the call returned.
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) std::rethrow_exception(broken_);
    for (const DeviceOp& d : dops) {
      auto it = deferred_.find(d.id);
      if (it == deferred_.end()) continue;
      const std::string why = std::move(it->second);
      deferred_.erase(it);
      throw_comm_error("fastcomm: rank " + std::to_string(rank_) + ", group " + d.label +
                       ": an earlier op of this group failed after its blocking call returned: " + why);
    }
  }
  auto batch = std::make_shared<Batch>();
  std::vector<std::unique_ptr<DevOp>> ops;
  std::vector<at::Tensor> outputs;
  c10d::OpType type = dops.size() == 1 ? op_kind_type(dops[0].req.kind) : c10d::OpType::COALESCED;
  // Per request: how many ops it was lowered into, and how many keys of its group it takes.
  std::vector<std::pair<size_t, size_t>> shape;
  for (auto& d : dops) {
    TORCH_CHECK_VALUE(!single_ || !d.recv_port || d.req.peer != kAnySource, "fastcomm.recv: rank ", rank_, ", group ",
                      d.label, ": a recv from any source needs the agreed channels (not FASTCOMM_DEVICE_SCHEME=single-stream)");
    Lowering how{*rt_, alloc_, rank_, !single_, group_comm_bytes_};
    how.links = links_only(d);
    std::unique_ptr<DevOp> second;
    ops.push_back(lower(d, batch, how, &second));
    const size_t lowered = second ? 2 : 1;
    if (second) ops.push_back(std::move(second));
    // A group linked over IPC takes two keys per op, whether it was lowered into two or not, so
    // members that chose differently (a mismatch, raised) still agree on the ops after it.
    shape.emplace_back(lowered, how.links && !d.recv_port ? 2 : 1);
    const OpRequest& r = d.req;
    if (r.kind == OpKind::kAllGather) outputs.insert(outputs.end(), r.list.begin(), r.list.end());
    else outputs.push_back(r.output.defined() ? r.output : r.tensor);
    batch->groups.push_back(d.id);
  }
  // The transfers start where the caller's stream is now: the inputs are ready there.
  EventPtr input = events_->record(caller);
  batch->work = c10::make_intrusive<DeviceWork>(shared_from_this(), rank_, type, std::move(outputs), 1, async_op);
  batch->left = batch->unlaunched = (int)ops.size();
  batch->one_op = dops.size() == 1;
  const auto now = Clock::now();
  auto work = batch->work;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) std::rethrow_exception(broken_);
    for (size_t i = 0, k = 0; i < dops.size(); k += shape[i].first, ++i) {
      for (size_t j = 0; j < shape[i].second; ++j) {
        DevOp* op = j < shape[i].first ? ops[k + j].get() : nullptr;
        Key key;
        // A recv from any source, and any recv of its (group, tag) posted while one waits, take
        // their receive numbers when bound, in posting order (device/recv_ports.h).
        const bool bound = numbers_.take(dops[i].id, op != nullptr && op->recv_port ? &op->port : nullptr,
                                         op != nullptr && op->any_source, key);
        if (op == nullptr) continue;
        op->key = key;
        op->unbound = !bound;
        op->input = input;
        op->deadline = now + op->timeout;
      }
      for (size_t j = 0; j < shape[i].first; ++j) incoming_.push_back(std::move(ops[k + j]));
    }
    if (ops.empty()) {
      work->set_launched({});
      work->settle(nullptr, true);
    }
  }
  cv_.notify_all();
  if (!async_op && rethrow) {
    // Returns once the ops are enqueued, the caller's stream ordered after them; the device
    // runs them later.
    wait_until(*work, true, std::chrono::milliseconds(0));
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!work->done()) batch->returned = true;
    }
    if (!work->done()) work->order_after(caller);
    else work->rethrow_if_failed();
  }
  return work;
}

void ChannelEngine::throw_capture_refusal(const std::vector<DeviceOp>& dops) const {
  const char* api = dops.empty() ? "batch" : op_kind_name(dops[0].req.kind);
  C10_THROW_ERROR(Error, c10::str("fastcomm.", api, ": rank ", rank_, dops.empty() ? "" : ", group ",
              dops.empty() ? "" : dops[0].label,
              ": issued while the caller's stream is being captured into a CUDA graph. fastcomm launches an op's "
              "transfers from its engine thread once the members have agreed on it, so an op issued under capture "
              "cannot be recorded into the graph; nothing was issued. Capture through a plan instead: record the ops "
              "once with `with fastcomm.plan() as p: ...`, then, outside any capture, `g = p.capture()` (the members "
              "agree on the order and matching once, there), and call `g.replay()` inside the capture (it records the "
              "plan's work into the graph) or outside it (docs/design.md, \"CUDA graphs\")"));
}

std::shared_ptr<DeviceGraph> ChannelEngine::capture(std::vector<DeviceOp> dops, bool naive) {
  TORCH_CHECK(!rt_->capturing(rt_->current_stream()), "fastcomm.plan.capture: rank ", rank_,
              ": called while the caller's stream is being captured; capture the plan outside any capture (it "
              "makes its own graph), then call `g.replay()` inside the capture (it records the plan's work into it)");
  TORCH_CHECK_VALUE(!single_, "fastcomm.plan.capture: rank ", rank_, ": not with FASTCOMM_DEVICE_SCHEME=single-stream");
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) std::rethrow_exception(broken_);
  }
  auto g = std::make_shared<PlanGraph>(shared_from_this(), *rt_, host_, rank_, alloc_, std::move(dops), naive);
  std::lock_guard<std::mutex> lk(graphs_mu_);
  graphs_.erase(std::remove_if(graphs_.begin(), graphs_.end(), [](const auto& w) { return w.expired(); }),
                graphs_.end());
  graphs_.push_back(g);
  return g;
}

void ChannelEngine::wait_until(Work& w, bool launched_enough, std::chrono::milliseconds timeout) {
  auto ready = [&] { return w.done() || (launched_enough && static_cast<DeviceWork&>(w).launched()); };
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout.count() <= 0) {
    done_cv_.wait(lk, ready);
  } else if (!done_cv_.wait_for(lk, timeout, ready)) {
    throw_comm_error("fastcomm: rank " + std::to_string(rank_) + ": device op not finished after " +
                     std::to_string(timeout.count()) + " ms (wait timed out)");
  }
}

void ChannelEngine::synchronize() {
  EventPtr e = events_->record(rt_->current_stream());
  rt_->synchronize(e->ev);
}

int64_t ChannelEngine::debug(const std::string& what, int64_t arg) {
  if (what == "events_created") return (int64_t)events_->created();
  if (what == "live_comms") return live_comms_.load();
  if (what == "ended_comms") return ended_comms_.load();
  if (what == "group_comms") return group_comms_.load();
  if (what == "join_streams") return join_streams_.load();
  if (what == "kernels") return slots_held_.load();
  if (what == "kernel_waits") return slot_waits_.load();
  if (what == "ipc_links") return ipc_->blocks();
  if (what == "ipc_links_made") return ipc_->made();
  if (what == "ipc_ring_bytes") return ipc_->ring_bytes();
  if (what == "ipc_host_rings") return ipc_->host_rings();
  if (what == "ipc_ring_fold_bytes") return ring_fold_bytes_.load();
  if (what == "ipc_skip_waits") {  // links made from now on
    ipc_->set_skip_rx_waits(arg != 0);
    return 0;
  }
  if (what == "channel_failed") {
    std::lock_guard<std::mutex> lk(mu_);
    return failed_peers_.count((int)arg) ? 1 : 0;
  }
  return rt_->debug(what, arg);
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
  std::vector<std::shared_ptr<PlanGraph>> graphs;
  {
    std::lock_guard<std::mutex> lk(graphs_mu_);
    for (auto& w : graphs_)
      if (auto g = w.lock()) graphs.push_back(std::move(g));
    graphs_.clear();
  }
  for (auto& g : graphs) g->abort("fastcomm was shut down");
}

// ---------------------------------------------------------------------------------------------
// The engine thread

void ChannelEngine::main() {
  // This thread's event queries and syncs must not break a CUDA graph the caller captures
  // meanwhile in the global capture mode.
  rt_->relax_capture_mode();
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
  teardown();
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

// ---------------------------------------------------------------------------------------------
// An op's life: ready -> every part launched -> end work enqueued (launched) -> transfers seen
// done (finished) -> its batch's ends have run (settled).

void ChannelEngine::part_launched(Part* p) {
  if (p->launched) return;
  p->launched = true;
  DevOp* op = p->op;
  if (--op->parts_unlaunched == 0 && op->gc == nullptr) to_end_.push_back(op);
}

void ChannelEngine::part_done(Part* p) {
  DevOp* op = p->op;
  if (--op->parts_left > 0) {
    if (op->chain > 0 && !op->launched) ready_part(op->parts[(size_t)--op->chain].get());
    return;
  }
  if (op->gc != nullptr) agreed(op);
  else if (op->launched) op_finished(op);
}

Stream ChannelEngine::join_stream(uint64_t group) {
  if (single_) return shared_;
  Stream& s = joins_[group];
  if (s == nullptr) {
    if (free_joins_.empty()) recycle_joins();
    if (!free_joins_.empty()) {
      s = free_joins_.back();
      free_joins_.pop_back();
    } else {
      s = rt_->new_stream();
      ++join_streams_;
    }
  }
  return s;
}

void ChannelEngine::recycle_joins() {
  for (auto it = joins_.begin(); it != joins_.end();) {
    // Nothing of the group is live, and its last end has run.
    auto e = last_end_.find(it->first);
    if (e != last_end_.end() && rt_->query(e->second.second->ev) == State::kReady) last_end_.erase(e);
    if (tail_.count(it->first) || last_end_.count(it->first)) {
      ++it;
      continue;
    }
    free_joins_.push_back(it->second);
    it = joins_.erase(it);
  }
}

// The end work of ops launched on all their channels. A pair op's folds go on its channel's
// stream, right behind its transfers; an op of 3+ members gathers its channels on its group's
// join stream, so a stalled peer holds the folds of its own groups only. Ops ending on one
// stream in one flush share one fold launch and one end event.
void ChannelEngine::flush_ends() {
  while (!to_end_.empty()) {
    std::vector<DevOp*> ops;
    ops.swap(to_end_);
    std::vector<std::pair<Stream, std::vector<DevOp*>>> by;
    for (DevOp* op : ops) {
      if (op->launched) continue;  // abandoned meanwhile
      Stream s = nullptr;
      const bool device_work = !op->parts.empty() || !op->copies.empty() || !op->folds.empty();
      if (!op->error && device_work) {
        Stream only = nullptr;
        bool one = !op->parts.empty();
        for (auto& p : op->parts) {
          if (only == nullptr) only = p->stream;
          one = one && p->stream == only;
        }
        s = one ? only : join_stream(op->key.id);
      }
      auto it = std::find_if(by.begin(), by.end(), [&](const auto& x) { return x.first == s; });
      if (it == by.end()) {
        by.emplace_back(s, std::vector<DevOp*>{});
        it = std::prev(by.end());
      }
      it->second.push_back(op);
    }
    std::vector<FoldJob> jobs;
    std::vector<Event> waited;
    for (auto& [s, list] : by) {
      if (s == nullptr) {  // failed ops: no end work
        for (DevOp* op : list) ended(op, nullptr, nullptr);
        continue;
      }
      jobs.clear();
      waited.clear();
      auto wait_once = [&](const EventPtr& e) {
        if (!e || std::find(waited.begin(), waited.end(), e->ev) != waited.end()) return;
        waited.push_back(e->ev);
        rt_->wait(s, e->ev);
      };
      bool enqueued = false;
      for (DevOp* op : list) {
        if (op->parts.empty()) {
          wait_once(op->input);
          if (op->pred_stream != s) wait_once(op->pred_end);
        }
        for (auto& p : op->parts)
          if (p->stream != s) wait_once(p->done_event);
        for (auto& [dst, src, n] : op->copies) rt_->copy(dst, src, n, s);
        jobs.insert(jobs.end(), op->folds.begin(), op->folds.end());
        enqueued = enqueued || !op->parts.empty() || !op->copies.empty();
      }
      if (!jobs.empty()) rt_->fold(jobs.data(), (int)jobs.size(), s);
      EventPtr end = enqueued || !jobs.empty() ? events_->record(s) : nullptr;
      for (DevOp* op : list) ended(op, s, end);
    }
  }
}

void ChannelEngine::ended(DevOp* op, Stream s, const EventPtr& end) {
  op->launched = true;
  if (end) {
    op->end = end;
    op->end_stream = s;
  } else {
    // Nothing of its own on a device: what the group's next op waits for is still the previous end.
    op->end = op->pred_end;
    op->end_stream = op->pred_stream;
  }
  if (op->end) last_end_[op->key.id] = {op->end_stream, op->end};
  else last_end_.erase(op->key.id);
  Batch& b = *op->batch;
  // Every stream the op's work went to, failed or not: its memory is held until each has run.
  auto add_end = [&](Stream st, const EventPtr& e) {
    if (st == nullptr || !e) return;
    auto it = std::find_if(b.ends.begin(), b.ends.end(), [&](const auto& x) { return x.first == st; });
    if (it == b.ends.end()) b.ends.emplace_back(st, e);
    else it->second = e;  // recorded later on the same stream: covers the earlier one
  };
  for (auto& p : op->parts) add_end(p->stream, p->done_event);
  if (end) add_end(s, end);
  b.keep.insert(b.keep.end(), op->keep.begin(), op->keep.end());
  if (op->scratch.defined()) b.keep.push_back(op->scratch);
  if (op->error) b.failed_early = true;
  // A batch with an op that failed before it was enqueued settles (raising) instead.
  if (--b.unlaunched == 0 && !b.failed_early) {
    std::vector<EventPtr> ends;
    for (auto& [st, e] : b.ends) ends.push_back(e);
    {
      std::lock_guard<std::mutex> lk(mu_);
      b.work->set_launched(std::move(ends));
    }
    done_cv_.notify_all();
  }
  if (op->gc == nullptr && op->parts_left == 0) op_finished(op);
  if (op->next != nullptr) {
    DevOp* n = op->next;
    op->next = nullptr;
    n->pred_end = op->end;
    n->pred_stream = op->end_stream;
    make_ready(n);
  }
}

void ChannelEngine::abandon(DevOp* op) {
  if (!op->launched) ended(op, nullptr, nullptr);
  if (!op->finished) op_finished(op);
}

void ChannelEngine::op_finished(DevOp* op) {
  if (op->finished) return;
  op->finished = true;
  Batch& b = *op->batch;
  if (op->error && !b.error) b.error = op->error;
  if (--b.left == 0) ending_.push_back(op->batch);
}

void ChannelEngine::fail_op(DevOp* op, std::exception_ptr e) {
  if (!op->error) op->error = e;
}

// Batches whose ops all finished: settled once their ends have run (failed or not: until then
// the device may still use their memory).
bool ChannelEngine::settle_ended() {
  bool moved = false;
  for (size_t i = 0; i < ending_.size();) {
    Batch& b = *ending_[i];
    bool ran = true;
    for (auto& [s, e] : b.ends)
      if (rt_->query(e->ev) != State::kReady) {
        ran = false;
        break;
      }
    if (!ran) {
      ++i;
      continue;
    }
    settle(b, b.error);
    ending_.erase(ending_.begin() + (long)i);
    moved = true;
  }
  return moved;
}

void ChannelEngine::settle(Batch& b, std::exception_ptr e) {
  bool fin, has_future = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    fin = b.work->settle(e, true, &has_future);
    if (fin && e && b.returned) {
      const std::string why = what_of(e);
      for (uint64_t g : b.groups) deferred_.emplace(g, why);
    }
  }
  b.keep.clear();
  done_cv_.notify_all();
  if (fin && has_future) publisher_.push(b.work);
}

}  // namespace device

std::shared_ptr<DeviceEngine> make_device_engine(const EngineOptions& opts, HostLink& host,
                                                 std::unique_ptr<device::Runtime> runtime) {
  return std::make_shared<device::ChannelEngine>(opts, host, std::move(runtime));
}

}  // namespace fastcomm
