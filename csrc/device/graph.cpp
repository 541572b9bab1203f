// A plan captured into a CUDA graph (device/graph.h): replays, runs inside user graphs, faults
// and release; and the runtimes' default graph calls. The capture's agreement is in
// graph_agree.cpp, the graph's work in graph_emit.cpp, its IPC links' ends in graph_links.cpp.
#include "device/graph.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <unordered_map>

#include "common/errors.h"

namespace fastcomm {
namespace device {

void Runtime::begin_capture(Stream) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime cannot capture CUDA graphs");
}
void* Runtime::end_capture(Stream) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime cannot capture CUDA graphs");
}
void Runtime::graph_launch(void*, Stream) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime cannot launch CUDA graphs");
}
void Runtime::graph_destroy(void*) {}
void Runtime::capture_keep(Stream, std::shared_ptr<void>) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime cannot keep objects with a graph");
}
void Runtime::host_call(Stream, void (*)(void*), void*) {
  TORCH_CHECK(false, "fastcomm: the ", name(), " device runtime cannot enqueue host calls");
}


PlanGraph::PlanGraph(std::shared_ptr<void> owner, Runtime& rt, HostLink& host, int rank, Stream alloc,
                     std::vector<DeviceOp> dops, bool naive, int64_t max_kernels, GraphLinks links)
    : owner_(std::move(owner)),
      rt_(rt),
      host_(host),
      rank_(rank),
      naive_(naive),
      max_kernels_(max_kernels),
      links_(std::move(links)) {
  try {
    origin_ = rt_.new_stream();
    // A careless design agrees and allocates with the capture already begun (tests show the
    // runtime refuses it).
    if (naive_) {
      rt_.begin_capture(origin_);
      open_capture_ = true;
    }
    auto batch = std::make_shared<Batch>();
    std::unordered_map<uint64_t, uint64_t> seq;
    const Lowering how{rt_, alloc, rank_, /*group_comms=*/false, 0};
    for (auto& d : dops) {
      auto op = lower(d, batch, how);
      op->key = Key{d.id, seq[d.id]++};
      timeout_ = std::max(timeout_, d.timeout);
      if (label_.find(d.label) == std::string::npos) label_ += (label_.empty() ? "" : ", ") + d.label;
      ops_.push_back(std::move(op));
    }
    if (timeout_.count() <= 0) timeout_ = std::chrono::minutes(30);
    // The canonical order: by group, then by place in the group. Every member of a group holds
    // its ops in the same order, so both sides of each pair see the same sequence.
    std::stable_sort(ops_.begin(), ops_.end(), [](const auto& a, const auto& b) {
      return a->key.id != b->key.id ? a->key.id < b->key.id : a->key.seq < b->key.seq;
    });
    for (auto& op : ops_)
      for (auto& p : op->parts) pair(p->peer).parts.push_back(p.get());
    agree();
    // An op's parts are no more than the plan's peers: within the bound, the pairs' streams keep
    // the kernels in flight within it too. Links launch no kernel that waits.
    const auto kernel_pairs = std::count_if(pairs_.begin(), pairs_.end(), [](const Pair& q) { return !q.link; });
    windowed_ = max_kernels_ > 0 && (int64_t)kernel_pairs > max_kernels_;
    serial_ = kernel_pairs > 0 && kernel_pairs < (int64_t)pairs_.size();
    if (serial_ && links_.serial) ++*links_.serial;
    connect();
    record_graph();
  } catch (...) {
    release();
    throw;
  }
}

PlanGraph::~PlanGraph() { release(); }

PlanGraph::Pair& PlanGraph::pair(int peer) {
  for (auto& p : pairs_)
    if (p.peer == peer) return p;
  pairs_.emplace_back();
  Pair& p = pairs_.back();
  p.peer = peer;
  p.leader = rank_ < peer;
  return p;
}

void PlanGraph::replay() {
  const Stream caller = rt_.current_stream();
  if (rt_.capturing(caller)) return record_into(caller);
  std::lock_guard<std::mutex> lk(mu_);
  check_locked(Check::kLaunch, timeout_);
  rt_.graph_launch(graph_, caller);
  Event e;
  if (!spare_.empty()) {
    e = spare_.back();
    spare_.pop_back();
  } else {
    e = rt_.new_event();
  }
  rt_.record(e, caller);
  runs_.push_back(Run{e, Clock::now()});
  ++replays_;
}

// A graph cannot be launched into a capture, so the plan's work is recorded anew into the
// caller's: the same calls as the plan's own capture, on the plan's communicators, streams and
// memory, forked from the caller's stream. No event query, sync or allocation here (they would
// invalidate a capture in the global mode): a fault of an earlier run raises, nothing else is
// looked at. Host calls around it count each run for the watcher.
void PlanGraph::record_into(Stream caller) {
  std::lock_guard<std::mutex> lk(mu_);
  if (broken_) std::rethrow_exception(broken_);
  if (!watch_) {
    watch_ = std::make_shared<Watch>();
    watcher_ = std::thread([this] { watch_loop(); });
  }
  keep_with(caller);
  rt_.host_call(caller, &Watch::on_start, watch_.get());
  emit(caller);
  rt_.host_call(caller, &Watch::on_end, watch_.get());
  ++recorded_;
}

void PlanGraph::Watch::on_start(void* p) {
  auto* w = static_cast<Watch*>(p);
  {
    std::lock_guard<std::mutex> lk(w->mu);
    ++w->started;
    w->begun.push_back(Clock::now());
  }
  w->cv.notify_all();
}

void PlanGraph::Watch::on_end(void* p) {
  auto* w = static_cast<Watch*>(p);
  {
    std::lock_guard<std::mutex> lk(w->mu);
    ++w->ended;
    if (!w->begun.empty()) w->begun.pop_front();
  }
  w->cv.notify_all();
}

int64_t PlanGraph::Watch::in_flight() {
  std::lock_guard<std::mutex> lk(mu);
  return started - ended;
}

// While a run of a user graph is in flight, looks at it every 2 ms as wait() would (a fault or
// the timeout aborts the plan's communicators, so the user's graph drains); sleeps otherwise.
void PlanGraph::watch_loop() {
  try {
    rt_.relax_capture_mode();  // its queries must not break a capture in the global mode
  } catch (...) {
    // A runtime already failing: the queries below fail the plan instead.
  }
  Watch& w = *watch_;
  for (;;) {
    {
      std::unique_lock<std::mutex> wl(w.mu);
      w.cv.wait(wl, [&] { return w.stop || (!w.idle && w.started > w.ended); });
      if (w.stop) return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      try {
        check_locked(Check::kWatch, timeout_);
      } catch (...) {
      }
      if (broken_) {
        std::lock_guard<std::mutex> wl(w.mu);
        w.idle = true;
      }
    }
    std::unique_lock<std::mutex> wl(w.mu);
    w.cv.wait_for(wl, std::chrono::milliseconds(2), [&] { return w.stop; });
  }
}

void PlanGraph::wait(std::chrono::milliseconds timeout) {
  const Stream caller = rt_.current_stream();
  TORCH_CHECK(!rt_.capturing(caller), "fastcomm.plan graph: rank ", rank_, ", groups ", label_,
              ": wait() while the caller's stream is being captured (it blocks the host); wait after the capture");
  std::lock_guard<std::mutex> lk(mu_);
  if (broken_) std::rethrow_exception(broken_);
  // Runs inside user graphs launched on the caller's stream and not started yet count too.
  Event until = nullptr;
  if (recorded_ > 0) {
    if (!spare_.empty()) {
      until = spare_.back();
      spare_.pop_back();
    } else {
      until = rt_.new_event();
    }
    rt_.record(until, caller);
  }
  try {
    check_locked(Check::kWait, timeout.count() > 0 ? timeout : timeout_, until);
  } catch (...) {
    if (until) spare_.push_back(until);
    throw;
  }
  if (until) spare_.push_back(until);
}

int64_t PlanGraph::replays() const {
  std::lock_guard<std::mutex> lk(mu_);
  return replays_;
}

int64_t PlanGraph::recorded() const {
  std::lock_guard<std::mutex> lk(mu_);
  return recorded_;
}

int64_t PlanGraph::user_runs() const {
  std::shared_ptr<Watch> w;
  {
    std::lock_guard<std::mutex> lk(mu_);
    w = watch_;
  }
  if (!w) return 0;
  std::lock_guard<std::mutex> wl(w->mu);
  return w->started;
}

std::string PlanGraph::fault_locked() {
  for (auto& q : pairs_) {
    std::string why;
    if (q.link) {
      if (q.link->peer_ended()) return "rank " + std::to_string(q.peer) + " ended its side of the plan's link";
    } else if (rt_.comm_state(q.comm, &why) == State::kFailed) {
      return "the plan's channel to rank " + std::to_string(q.peer) + " failed: " + why;
    }
    if (!host_.peer_alive(q.peer)) return "rank " + std::to_string(q.peer) + " is gone";
  }
  return "";
}

void PlanGraph::check_locked(Check how, std::chrono::milliseconds timeout, Event until) {
  if (broken_) std::rethrow_exception(broken_);
  const auto start = Clock::now();
  auto harvest = [&] {
    while (!runs_.empty() && rt_.query(runs_.front().end) == State::kReady) {
      spare_.push_back(runs_.front().end);
      runs_.pop_front();
    }
  };
  auto user_in_flight = [&] { return watch_ ? watch_->in_flight() : 0; };
  auto in_flight = [&] { return !runs_.empty() || user_in_flight() > 0; };
  auto settled = [&] {
    harvest();
    return !in_flight() && (how != Check::kWait || !until || rt_.query(until) == State::kReady);
  };
  // The start of the oldest run in flight.
  auto oldest = [&] {
    auto t = runs_.empty() ? Clock::time_point::max() : runs_.front().launched;
    if (watch_) {
      std::lock_guard<std::mutex> wl(watch_->mu);
      if (!watch_->begun.empty()) t = std::min(t, watch_->begun.front());
    }
    return t;
  };
  // Garbage is looked at after each harvest: the failed side sets it before releasing its
  // waits, so a run seen done after that may have read what the release let through.
  auto no_garbage = [&] {
    const std::string garbage = garbage_locked();
    if (!garbage.empty()) fail_locked(garbage);
  };
  for (int spins = 0;; ++spins) {
    const bool done = settled();
    no_garbage();
    if (done && how != Check::kLaunch) return;
    // A fault matters while runs are in flight or one is about to be launched (a replay
    // against a dead peer would never finish).
    const std::string fault = fault_locked();
    if (!fault.empty()) {
      if (how == Check::kLaunch) fail_locked(fault);
      // A peer that finished its runs and left: this side's last run may still be folding.
      // Harvest what already ran for a while before failing.
      const auto grace = Clock::now() + std::chrono::seconds(1);
      while (!settled() && Clock::now() < grace) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (!settled()) fail_locked(fault);
      no_garbage();
      return;
    }
    const auto now = Clock::now();
    const auto first = oldest();
    const auto age = first == Clock::time_point::max()
                         ? std::chrono::milliseconds(0)
                         : std::chrono::duration_cast<std::chrono::milliseconds>(now - first);
    if (age > timeout_ || (how == Check::kWait && now - start > timeout)) {
      std::vector<int> ranks;
      for (auto& q : pairs_) ranks.push_back(q.peer);
      std::sort(ranks.begin(), ranks.end());
      std::string peers;
      for (int r : ranks) peers += (peers.empty() ? "" : ", ") + std::to_string(r);
      fail_locked("a replay of the graph not done after " +
                  std::to_string(std::max(age, std::chrono::duration_cast<std::chrono::milliseconds>(now - start)).count()) +
                  " ms (timeout); the plan's peers: ranks [" + peers + "]");
    }
    if (how != Check::kWait) return;
    if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(200));
    else std::this_thread::yield();
  }
}

void PlanGraph::fail_locked(const std::string& why) {
  broken_ = comm_error_ptr("fastcomm.plan graph: rank " + std::to_string(rank_) + ", groups " + label_ + ": " + why +
                           "; the graph is dead (capture the plan again)");
  // The graph goes first (a launch in flight keeps it until it ends): NCCL's abort returns only
  // once no graph holds work of the communicator.
  if (graph_) {
    try {
      rt_.graph_destroy(graph_);
    } catch (...) {
    }
    graph_ = nullptr;
  }
  abort_comms();  // the runs in flight return without moving data
  // A link's runs in flight here go on to their end once their waits are released; the peer is
  // told first that what they write is garbage.
  for (auto& q : pairs_)
    if (q.link) q.link->end_fixed(/*failed=*/true);
  start_drain();
  std::rethrow_exception(broken_);
}

void PlanGraph::abort_comms() {
  std::vector<Comm> comms;
  for (auto& q : pairs_) {
    if (q.comm) comms.push_back(q.comm);
    q.comm = nullptr;
  }
  if (comms.empty()) return;
  // On a thread of its own, never joined: NCCL's abort stops the kernels at once but returns
  // only once every graph holding their work is destroyed, and a user's graph that recorded a
  // replay may outlive the plan. The thread keeps the runtime alive (owner_) until then, and
  // what a run in flight may still write or call back (the ops' memory, the watch) until the
  // communicators are gone: the plan may be dropped before its abort has even begun.
  // Each communicator's abort on a thread of its own, all at once: a graph run in flight ends only
  // once every one of its kernels has, so an abort that waited for it before the next abort had
  // even begun could wait for good (a kernel of another communicator still waiting on a peer).
  struct Held {
    std::vector<std::unique_ptr<DevOp>> ops;
    std::shared_ptr<Watch> watch;
  };
  auto held = std::make_shared<Held>();
  held->ops = std::move(ops_);
  held->watch = watch_;
  Runtime* rt = &rt_;
  auto body = [owner = owner_, rt, comms, held] {
    auto relaxed = [rt] {
      try {
        rt->relax_capture_mode();  // NCCL syncs its streams: that must not break a user's capture
      } catch (...) {
      }
    };
    auto abort_one = [rt, relaxed](Comm c) {
      relaxed();
      try {
        rt->comm_abort(c);
      } catch (...) {
      }
    };
    relaxed();  // for the destroys below
    std::vector<std::thread> aborts;
    for (Comm c : comms) {
      try {
        aborts.emplace_back(abort_one, c);
      } catch (...) {
        abort_one(c);  // no thread to be had: in line (it may wait for the graphs holding `c`)
      }
    }
    for (auto& t : aborts) t.join();
    for (Comm c : comms) {
      try {
        rt->comm_destroy(c);
      } catch (...) {
      }
    }
    held->ops.clear();  // before `owner`: freeing scratch needs the runtime
    held->watch.reset();
  };
  try {
    std::thread(body).detach();
  } catch (...) {
    body();  // no thread to be had: in line, rather than free what a run may still write
  }
  ops_.clear();  // moved from: the plan fails or goes, nothing reads them again
}

void PlanGraph::abort(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (broken_) return;
  try {
    fail_locked(why);
  } catch (...) {
  }
}

void PlanGraph::release() {
  if (watcher_.joinable()) {
    {
      std::lock_guard<std::mutex> wl(watch_->mu);
      watch_->stop = true;
    }
    watch_->cv.notify_all();
    watcher_.join();
  }
  std::lock_guard<std::mutex> lk(mu_);
  // Runs in flight (user graphs' started ones too) finish, or fail, aborting the communicators
  // so that they drain, before the memory and communicators go: a replay may still write the
  // scratch. A user graph must not be replayed once the plan's graph is gone.
  if (!broken_ && (!runs_.empty() || (watch_ && watch_->in_flight() > 0))) {
    if (links_.releasing) ++*links_.releasing;
    try {
      check_locked(Check::kWait, timeout_);
    } catch (...) {
    }
    if (links_.releasing) --*links_.releasing;
  }
  for (auto& r : runs_) {
    try {
      rt_.synchronize(r.end);
    } catch (...) {
    }
    spare_.push_back(r.end);
  }
  runs_.clear();
  // A failed plan's links drain the user graphs' runs in flight too (the drain releases them).
  if (broken_ && drain_.joinable() && watch_) {
    const auto until = Clock::now() + timeout_;
    while (watch_->in_flight() > 0 && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // A user's capture holds the plan's links (keep_) once it was given them, even where the
  // recording failed after: its communicators then go as for a recorded plan's.
  const bool held = recorded_ > 0 || keep_ != nullptr;
  end_links();
  auto quietly = [](auto f) {
    try {
      f();
    } catch (...) {
    }
  };
  if (open_capture_) quietly([&] { rt_.graph_destroy(rt_.end_capture(origin_)); });  // refused or dropped
  open_capture_ = false;
  if (graph_) quietly([&] { rt_.graph_destroy(graph_); });
  graph_ = nullptr;
  // A user's graph that recorded a replay holds work of the communicators, and NCCL destroys
  // them only once it is gone: those are aborted on a thread that waits for it.
  if (held) abort_comms();
  for (auto& q : pairs_) {
    if (q.comm) quietly([&] { rt_.comm_destroy(q.comm); });
    if (q.stream && q.stream != links_stream_) quietly([&] { rt_.destroy_stream(q.stream); });
    q.comm = nullptr;
    q.stream = nullptr;
  }
  if (links_stream_) quietly([&] { rt_.destroy_stream(links_stream_); });
  links_stream_ = nullptr;
  if (join_) quietly([&] { rt_.destroy_stream(join_); });
  if (retire_) quietly([&] { rt_.destroy_stream(retire_); });
  retire_ = nullptr;
  if (origin_) quietly([&] { rt_.destroy_stream(origin_); });
  join_ = origin_ = nullptr;
  for (Event e : spare_) quietly([&] { rt_.destroy_event(e); });
  spare_.clear();
  for (Event e : emit_events_) quietly([&] { rt_.destroy_event(e); });
  emit_events_.clear();
  ops_.clear();
}

}  // namespace device
}  // namespace fastcomm
