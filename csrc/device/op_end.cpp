// The end of a device op's life (device/channel_engine.h): parts launched and done, the end
// work of ops launched on all their channels (folds, the end event, join streams), ops finished,
// and their batch settled once its ends have run.
#include <algorithm>

#include "device/channel_engine.h"

namespace fastcomm {
namespace device {

namespace {

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
    try {
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
      for (auto& [s, list] : by) end_on(s, list, jobs, waited);
    } catch (...) {
      // Only a broken device fails a call here: the ops not ended yet go back, for teardown to
      // end once it has failed them.
      for (DevOp* op : ops)
        if (!op->launched) to_end_.push_back(op);
      throw;
    }
  }
}

// The end work of `list`, the ops ending together on stream `s` (null: failed ops, none).
void ChannelEngine::end_on(Stream s, const std::vector<DevOp*>& list, std::vector<FoldJob>& jobs,
                           std::vector<Event>& waited) {
  if (s == nullptr) {
    for (DevOp* op : list) ended(op, nullptr, nullptr);
    return;
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
    // The later record on a stream covers the earlier: not the later call here (an op of 3+
    // ended after a pair op brings its part's event, recorded at its launch, before the pair
    // op's end work).
    else if (e->seq > it->second->seq) it->second = e;
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
    if (fin && e && (b.returned || b.work->returned)) {
      const std::string why = what_of(e);
      for (uint64_t g : b.groups) deferred_.emplace(g, why);
    }
  }
  b.keep.clear();
  done_cv_.notify_all();
  if (fin && has_future) publisher_.push(b.work, b.nested);
}

}  // namespace device
}  // namespace fastcomm
