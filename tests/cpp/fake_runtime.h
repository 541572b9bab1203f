#pragma once
// What the unit tests of the fake device runtime share (test_fake_runtime, test_fake_graphs,
// test_graph_links).
#include <chrono>
#include <functional>
#include <memory>
#include <thread>

#include "device/runtime.h"

namespace fastcomm::device::testing {

// pred() within `limit`, polled.
inline bool eventually(const std::function<bool()>& pred,
                       std::chrono::milliseconds limit = std::chrono::milliseconds(5000)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  for (;;) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() >= end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// An event recorded on `s` now.
inline Event mark(Runtime& rt, Stream s) {
  Event e = rt.new_event();
  rt.record(e, s);
  return e;
}

inline bool ready(Runtime& rt, Event e) { return rt.query(e) == State::kReady; }

// A fake whose launches leave their communicators usable at once (the ncclInProgress window
// has a test of its own).
inline std::unique_ptr<Runtime> fake() {
  auto rt = make_fake_runtime();
  rt->debug("enqueue_us", 0);
  return rt;
}

}  // namespace fastcomm::device::testing
