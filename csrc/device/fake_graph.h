#pragma once
// The CPU fake's CUDA graphs (fake_runtime.cpp has the whole list of what it keeps): a capture
// (fake_streams.h keeps the one under way) ended into a graph, the graph's replay, and the
// capture side of event records and waits. Included by fake_runtime_impl.h only.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "device/fake_streams.h"

namespace fastcomm {
namespace device {
namespace fake {

// debug("lane_stagger", ms): each launch of a graph starts lane i >= 1 (the streams forked from
// the launching one) after (i - 1) * ms (ms < 0: after (lanes - 1 - i) * -ms), so a test
// chooses which branch of a graph reaches the device first, as a GPU's scheduler may (0: all at
// once).
inline std::atomic<int64_t>& lane_stagger_ms() {
  static std::atomic<int64_t> ms{0};
  return ms;
}

// An instantiated graph: its lanes run at each launch, lane 0 on the launching stream's thread,
// the others on workers of the graph's own; each launch takes fresh markers for its slots, so
// the records and waits of one replay order only that replay. Launches of one graph run one at a
// time, in launch order.
struct FakeGraph {
  std::vector<std::shared_ptr<void>> refs;  // released with the graph (GraphBuild::refs)
  std::vector<std::vector<GraphNode>> lanes;
  int slots = 0;
  std::vector<std::unique_ptr<StreamCore>> workers;  // lanes 1..
  std::mutex run_mu;

  // The references go as CUDA's user objects do: later, on a thread of CUDA's own.
  ~FakeGraph() {
    if (refs.empty()) return;
    std::thread([r = std::move(refs)]() mutable {
      tl_in_callback = true;
      r.clear();
    }).detach();
  }

  void run() {
    std::lock_guard<std::mutex> lk(run_mu);
    std::vector<std::shared_ptr<Marker>> marks((size_t)slots);
    for (auto& m : marks) m = std::make_shared<Marker>();
    std::vector<std::shared_ptr<Marker>> done;
    const int64_t stagger = lane_stagger_ms().load();
    auto delay = [&](size_t i) {
      const int64_t n = (int64_t)lanes.size();
      return std::chrono::milliseconds(stagger >= 0 ? ((int64_t)i - 1) * stagger : (n - 1 - (int64_t)i) * -stagger);
    };
    for (size_t i = 1; i < lanes.size(); ++i) {
      auto d = std::make_shared<Marker>();
      done.push_back(d);
      std::function<void()> f = [this, i, marks, d, wait = delay(i)] {
        std::this_thread::sleep_for(wait);
        run_lane(i, marks);
        d->set();
      };
      if (!workers[i - 1]->push(f)) f();
    }
    run_lane(0, marks);
    for (auto& d : done) d->wait();
  }

  void run_lane(size_t i, const std::vector<std::shared_ptr<Marker>>& marks) {
    for (auto& n : lanes[i]) {
      if (n.kind == GraphNode::kRecord) {
        marks[(size_t)n.slot]->set();
      } else if (n.kind == GraphNode::kWait) {
        marks[(size_t)n.slot]->wait();
      } else {
        try {
          n.task();
        } catch (const std::exception& e) {
          std::fprintf(stderr, "fastcomm fake runtime: a graph node failed: %s\n", e.what());
        }
      }
    }
  }
};


// record(ev) on stream `st`: true where `st` is captured (the record is a slot of the graph,
// set at each replay).
inline bool capture_record(EventImpl& ev, const void* st) {
  Capture& c = capture();
  if (c.active.load() == 0) return false;
  std::lock_guard<std::mutex> lk(c.mu);
  const int lane = c.lane_of(st);
  if (lane < 0) return false;
  const int slot = c.build->slots++;
  c.build->lanes[(size_t)lane].push_back({GraphNode::kRecord, {}, slot});
  std::lock_guard<std::mutex> el(ev.mu);
  ev.latest = nullptr;
  ev.cap = c.build;
  ev.slot = slot;
  return true;
}

// wait(st, ev): true where it is a wait of the capture (a stream not in it joins it); refused
// where a captured stream waits on a record outside the capture, or on one of a capture that
// ended. Else `*m` gets the marker of the event's latest record.
inline bool capture_wait(EventImpl& ev, const void* st, std::shared_ptr<Marker>* m) {
  std::shared_ptr<GraphBuild> cap;
  int slot;
  {
    std::lock_guard<std::mutex> lk(ev.mu);
    *m = ev.latest;
    cap = ev.cap;
    slot = ev.slot;
  }
  Capture& c = capture();
  if (!cap && c.active.load() == 0) return false;
  std::lock_guard<std::mutex> lk(c.mu);
  int lane = c.lane_of(st);
  if (cap) {
    if (c.build != cap)
      call_error("wait", "the event's latest record was captured into a graph whose capture has ended; only a "
                         "replay runs it (cudaErrorStreamCaptureUnsupported)");
    if (lane < 0) {  // the stream joins the capture
      lane = (int)cap->lanes.size();
      cap->lanes.emplace_back();
      cap->streams.push_back(st);
    }
    cap->lanes[(size_t)lane].push_back({GraphNode::kWait, {}, slot});
    return true;
  }
  if (lane >= 0) {
    c.build->invalidated = true;
    c.build->why = "a wait on an event recorded outside the capture";
    call_error("wait", "a captured stream may not wait on an event recorded outside the capture (a graph holds "
                       "only its own work; cudaErrorStreamCaptureIsolation); the capture is invalidated");
  }
  return false;
}

inline void start_capture(const std::shared_ptr<StreamCore>& st, bool global) {
  if (st->host) call_error("begin_capture", "the host stream cannot be captured");
  Capture& c = capture();
  std::lock_guard<std::mutex> lk(c.mu);
  if (c.build) call_error("begin_capture", "a capture is under way in this process (the fake runs one at a time)");
  auto b = std::make_shared<GraphBuild>();
  b->global = global;
  b->owner = std::this_thread::get_id();
  b->lanes.emplace_back();
  b->streams.push_back(st.get());
  c.build = std::move(b);
  c.active = 1;
}

// Ends the capture begun on `st`: its graph, or a CommError where the capture is refused.
inline std::shared_ptr<FakeGraph> finish_capture(const std::shared_ptr<StreamCore>& st) {
  std::shared_ptr<GraphBuild> b;
  {
    Capture& c = capture();
    std::lock_guard<std::mutex> lk(c.mu);
    if (!c.build || c.build->streams[0] != st.get()) call_error("end_capture", "no capture began on this stream");
    b = std::move(c.build);
    c.active = 0;
  }
  // A refused capture makes no graph: what it held goes now (events recorded in it keep the build).
  if (b->invalidated) {
    b->refs.clear();
    call_error("end_capture", "the capture was invalidated (" + b->why + ")");
  }
  // Every stream that joined must be joined back: its last node a record that a joined
  // lane waits on (cudaErrorStreamCaptureUnjoined).
  const size_t n = b->lanes.size();
  std::vector<bool> joined(n, false);
  joined[0] = true;
  for (bool more = true; more;) {
    more = false;
    for (size_t i = 1; i < n; ++i) {
      if (joined[i]) continue;
      const auto& l = b->lanes[i];
      if (l.empty() || l.back().kind != GraphNode::kRecord) continue;
      for (size_t j = 0; j < n && !joined[i]; ++j) {
        if (!joined[j]) continue;
        for (const auto& x : b->lanes[j])
          if (x.kind == GraphNode::kWait && x.slot == l.back().slot) {
            joined[i] = more = true;
            break;
          }
      }
    }
  }
  for (size_t i = 1; i < n; ++i)
    if (!joined[i]) {
      b->refs.clear();
      call_error("end_capture", "a stream that joined the capture has work that the capture's stream does not wait "
                                "for (cudaErrorStreamCaptureUnjoined)");
    }
  auto g = std::make_shared<FakeGraph>();
  g->lanes = std::move(b->lanes);
  g->slots = b->slots;
  g->refs = std::move(b->refs);
  for (size_t i = 1; i < n; ++i) g->workers.emplace_back(new StreamCore(false));
  return g;
}

// graph_launch on `st`: refused where `st` is captured (a graph is launched, not captured, so a
// plan's graph goes into a larger capture only as its work recorded anew, device/graph.h).
inline void refuse_launch_under_capture(const void* st) {
  Capture& c = capture();
  if (c.active.load() == 0) return;
  std::lock_guard<std::mutex> lk(c.mu);
  if (c.lane_of(st) < 0) return;
  c.build->invalidated = true;
  c.build->why = "a graph launched into the capture";
  call_error("graph_launch", "operation not permitted when stream is capturing: a graph cannot be launched into "
                             "a stream capture (cudaErrorStreamCaptureUnsupported); the capture is invalidated");
}

inline void refuse_captured(EventImpl& ev, const char* call) {
  std::lock_guard<std::mutex> lk(ev.mu);
  if (ev.cap)
    call_error(call, "the event's latest record was captured into a CUDA graph: the host cannot wait on work "
                     "that runs only at a replay (cudaErrorStreamCaptureUnsupported)");
}

}  // namespace fake
}  // namespace device
}  // namespace fastcomm
