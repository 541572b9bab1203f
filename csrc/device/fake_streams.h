#pragma once
// The CPU fake of the device runtime (fake_runtime.cpp has the whole list of what it keeps):
// its streams (worker threads), events (markers), freed scratch (poisoned, watched for late
// writes) and capture modes. Included by fake_comm.h and fake_runtime_impl.h only.
#include <pthread.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "device/runtime.h"

namespace fastcomm {
namespace device {
namespace fake {

using RedOp = c10d::ReduceOp::RedOpType;
using Clock = std::chrono::steady_clock;

[[noreturn]] inline void call_error(const char* call, const std::string& what) {
  throw_comm_error(std::string("fastcomm fake runtime: ") + call + ": " + what);
}

// ------------------------------------------------------------------------------------------
// Freed scratch and capture: process-wide, as a device's memory and CUDA's capture mode are.

// Freed scratch blocks, poisoned and kept (up to a bound) so a late write into one is seen.
struct Quarantine {
  std::mutex mu;
  std::deque<std::pair<uint8_t*, size_t>> blocks;
  size_t bytes = 0;
  std::atomic<int64_t> late_writes{0};
  static constexpr size_t kMaxBytes = size_t(64) << 20;

  void add(void* p, size_t n) {
    std::memset(p, 0xa5, n);
    std::lock_guard<std::mutex> lk(mu);
    blocks.emplace_back(static_cast<uint8_t*>(p), n);
    bytes += n;
    while (bytes > kMaxBytes && !blocks.empty()) {
      bytes -= blocks.front().second;
      ::free(blocks.front().first);
      blocks.pop_front();
    }
  }
  // A stream is about to write [p, p + n).
  void check(const void* p, size_t n) {
    if (n == 0) return;
    const auto* b = static_cast<const uint8_t*>(p);
    std::lock_guard<std::mutex> lk(mu);
    for (auto& [q, m] : blocks) {
      if (b < q + m && q < b + n) {
        ++late_writes;
        std::fprintf(stderr, "fastcomm fake runtime: a stream wrote %zu bytes into freed scratch\n", n);
        return;
      }
    }
  }
};
inline Quarantine& quarantine() {
  static Quarantine* q = new Quarantine();  // never destroyed: streams may write at exit
  return *q;
}

// A CUDA graph capture (one at a time in a process: the fake's limit). Work enqueued on a
// captured stream is kept as the nodes of a lane instead of run; a stream joins the capture when
// it waits on an event recorded in it (lane 1, 2, ...); records and waits inside the capture
// become slots that order the lanes at each replay.
struct GraphNode {
  enum Kind { kTask, kRecord, kWait } kind = kTask;
  std::function<void()> task;  // kTask: run at every replay, so it must be rerunnable
  int slot = -1;               // kRecord, kWait
};
struct GraphBuild {
  std::vector<std::shared_ptr<void>> refs;  // held by the graph for its life (capture_hold)
  bool global = false;   // the global mode (else thread-local)
  std::thread::id owner;  // the thread that began the capture
  bool invalidated = false;
  std::string why;
  std::vector<std::vector<GraphNode>> lanes;  // lane 0: the stream the capture began on
  std::vector<const void*> streams;           // each lane's stream
  int slots = 0;
};

struct Capture {
  std::mutex mu;
  std::atomic<int> active{0};          // a capture is under way (read without the lock)
  std::shared_ptr<GraphBuild> build;  // under mu
  // The lane of stream `s` in the capture under way, or -1. Under mu.
  int lane_of(const void* s) const {
    if (!build) return -1;
    for (size_t i = 0; i < build->streams.size(); ++i)
      if (build->streams[i] == s) return (int)i;
    return -1;
  }
};
inline Capture& capture() {
  static Capture* c = new Capture();
  return *c;
}
inline thread_local bool tl_relaxed = false;

// Set on the thread that drops a graph's references, as CUDA runs user objects' destructors on
// a thread of its own, where no CUDA call may be made: such a call is reported and counted
// (debug "callback_calls").
inline thread_local bool tl_in_callback = false;
inline std::atomic<int64_t>& callback_calls() {
  static std::atomic<int64_t> n{0};
  return n;
}
inline void note_callback_call(const char* call) {
  if (!tl_in_callback) return;
  callback_calls().fetch_add(1);
  std::fprintf(stderr, "fastcomm fake runtime: %s from a user object's destructor, where CUDA allows no call\n", call);
}

// A call CUDA calls potentially unsafe during a capture (an event query or sync, an
// allocation): in the global mode from any thread not in the relaxed mode, in the thread-local
// mode from the capturing thread, it invalidates the capture and fails.
inline void unsafe_call(const char* call) {
  note_callback_call(call);
  if (tl_relaxed) return;
  Capture& c = capture();
  if (c.active.load() == 0) return;
  std::lock_guard<std::mutex> lk(c.mu);
  if (!c.build || (!c.build->global && c.build->owner != std::this_thread::get_id())) return;
  c.build->invalidated = true;
  c.build->why = std::string(call) + " during the capture";
  call_error(call, std::string("operation not permitted when stream is capturing (a graph is captured in the ") +
                       (c.build->global ? "global mode and this thread is not in the relaxed mode" : "thread-local mode by this thread") +
                       "); the capture is invalidated");
}

// Keeps `f` as a node of the capture under way when `s` is one of its streams.
inline bool capture_task(const void* s, std::function<void()>& f) {
  Capture& c = capture();
  if (c.active.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> lk(c.mu);
  const int lane = c.lane_of(s);
  if (lane < 0) return false;
  c.build->lanes[(size_t)lane].push_back({GraphNode::kTask, std::move(f), -1});
  return true;
}

// Makes the graph being captured on `s` hold `ref` for as long as it lives (the graph, or the
// capture if it never becomes one).
inline void capture_hold(const void* s, std::shared_ptr<void> ref) {
  Capture& c = capture();
  std::lock_guard<std::mutex> lk(c.mu);
  if (c.lane_of(s) >= 0) c.build->refs.push_back(std::move(ref));
}

// ------------------------------------------------------------------------------------------
// Streams and events

struct StreamCore {
  const bool host;  // the host stream: its work runs at once on the calling thread
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> q;
  bool stopping = false;  // destroy_stream: drain, then end
  bool closed = false;    // the worker has ended; nothing runs on it any more
  std::thread th;

  explicit StreamCore(bool host_stream) : host(host_stream) {
    if (!host) th = std::thread([this] { loop(); });
  }
  ~StreamCore() {
    if (th.joinable()) {
      if (th.get_id() == std::this_thread::get_id()) th.detach();
      else stop();
    }
  }

  // Queues `f` behind everything enqueued so far; false (f left as it was) where the stream has
  // ended.
  bool push(std::function<void()>& f) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (closed) return false;
      q.push_back(std::move(f));
    }
    cv.notify_one();
    return true;
  }

  // Runs what is queued, then ends the worker.
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stopping = true;
    }
    cv.notify_one();
    if (th.joinable()) th.join();
  }

  void loop() {
    pthread_setname_np(pthread_self(), "fcfake-stream");
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return !q.empty() || stopping; });
        if (q.empty()) {
          closed = true;
          return;
        }
        f = std::move(q.front());
        q.pop_front();
      }
      try {
        f();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "fastcomm fake runtime: a stream task failed: %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "fastcomm fake runtime: a stream task failed\n");
      }
      // `f` (and what it holds: tensors kept alive, communicators) goes here, outside the lock.
    }
  }
};

// Runs `f` on `s`: kept for replay when `s` is captured, now on the host stream (or on one that
// has ended), else queued.
inline void run_on(StreamCore& s, std::function<void()> f) {
  if (capture_task(&s, f)) return;
  if (s.host || !s.push(f)) f();
}

// One record(): done once the stream reaches it.
struct Marker {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  void set() {
    {
      std::lock_guard<std::mutex> lk(mu);
      done = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return done; });
  }
  bool ready() {
    std::lock_guard<std::mutex> lk(mu);
    return done;
  }
};

struct EventImpl {
  std::mutex mu;
  std::shared_ptr<Marker> latest;  // null: never recorded (complete), or recorded under capture
  std::shared_ptr<GraphBuild> cap;  // the latest record was captured: into this build's `slot`
  int slot = -1;
  std::shared_ptr<Marker> get() {
    std::lock_guard<std::mutex> lk(mu);
    return latest;
  }
};

// How many communicator kernels the device holds resident at once (debug "resident_limit"; 0:
// any number). A kernel that reaches the front of its stream past the limit makes no progress,
// its sends unwritten and its receives untaken, until a resident one ends, as on a GPU whose
// SMs are full; it is admitted in the order it arrived. One whose communicator was aborted
// runs at once (it moves nothing). Counts kernels that waited (debug "resident_waits").
struct Residency {
  std::mutex mu;
  std::condition_variable cv;
  int64_t limit = 0;
  int64_t resident = 0;
  int64_t waits = 0;
  uint64_t next_ticket = 0, serving = 0;  // FIFO admission
  // Returns whether a slot was taken (give it back with leave()).
  template <typename Aborted>
  bool enter(Aborted aborted) {
    std::unique_lock<std::mutex> lk(mu);
    if (limit <= 0) return false;
    const uint64_t me = next_ticket++;
    if (resident >= limit || serving != me) ++waits;
    while (resident >= limit || serving != me) {
      if (aborted()) {
        // Leaves the line: later tickets must not wait for this one.
        skip(me);
        return false;
      }
      cv.wait_for(lk, std::chrono::milliseconds(2));
    }
    ++serving;
    flush_skipped();
    ++resident;
    cv.notify_all();
    return true;
  }
  void leave() {
    std::lock_guard<std::mutex> lk(mu);
    --resident;
    cv.notify_all();
  }

 private:
  std::vector<uint64_t> skipped_;
  void skip(uint64_t t) {
    if (t == serving) {
      ++serving;
      flush_skipped();
    } else {
      skipped_.push_back(t);
    }
    cv.notify_all();
  }
  void flush_skipped() {
    for (bool again = true; again;) {
      again = false;
      for (auto it = skipped_.begin(); it != skipped_.end(); ++it) {
        if (*it == serving) {
          ++serving;
          skipped_.erase(it);
          again = true;
          break;
        }
      }
    }
  }
};

// A kernel's place among the resident ones, given back however its run ends.
struct ResidentSlot {
  Residency& r;
  const bool held;
  ResidentSlot(Residency& res, bool taken) : r(res), held(taken) {}
  ResidentSlot(const ResidentSlot&) = delete;
  ResidentSlot& operator=(const ResidentSlot&) = delete;
  ~ResidentSlot() {
    if (held) r.leave();
  }
};

}  // namespace fake
}  // namespace device
}  // namespace fastcomm
