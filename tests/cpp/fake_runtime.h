#pragma once
// What the unit tests of the fake device runtime share (test_fake_runtime, test_fake_nccl,
// test_fake_graphs, test_graph_links): polls with a deadline, the ranks of one communicator, and
// a gate that holds a stream back.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "device/runtime.h"
#include "unit.h"

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


using RedOp = c10d::ReduceOp::RedOpType;
using std::chrono::milliseconds;

// pred() all along `span` (a negative check: what must not happen has not, for a while).
inline bool stays(const std::function<bool()>& pred, milliseconds span = milliseconds(60)) {
  const auto end = std::chrono::steady_clock::now() + span;
  while (std::chrono::steady_clock::now() < end) {
    if (!pred()) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return pred();
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

inline bool done(Runtime& rt, Event e) {
  return eventually([&] { return ready(rt, e); });
}

// The ranks of one communicator, one Runtime each, each with a stream.
struct Ranks {
  std::vector<std::unique_ptr<Runtime>> rt;
  std::vector<Comm> comm;
  std::vector<Stream> stream;
  UniqueId id;

  // Ranks 0..n-1; the first `init` of them call comm_init.
  explicit Ranks(int n, int init = -1) : comm(n, nullptr) {
    for (int r = 0; r < n; ++r) {
      rt.push_back(fake());
      stream.push_back(rt.back()->new_stream());
    }
    id = rt[0]->new_id();
    for (int r = 0; r < (init < 0 ? n : init); ++r) join(r);
  }
  void join(int r) { comm[r] = rt[r]->comm_init(id, static_cast<int>(rt.size()), r); }
  State state(int r, std::string* why = nullptr) { return rt[r]->comm_state(comm[r], why); }
  bool all_ready() {
    return eventually([&] {
      for (size_t r = 0; r < rt.size(); ++r)
        if (state(static_cast<int>(r)) != State::kReady) return false;
      return true;
    });
  }
  // kFailed with a reason containing `part`, within the deadline.
  bool fails_with(int r, const std::string& part) {
    std::string why;
    const bool ok = eventually([&] { return state(r, &why) == State::kFailed; });
    CHECK_MSG(!ok || contains(why, part), "rank " << r << " failed with '" << why << "', wanted '" << part << "'");
    return ok && contains(why, part);
  }
};

// An event of `rt` that becomes ready only at open(): the record behind a send to a helper rank
// that receives only then (the one way to hold a stream back in this runtime).
struct Gate {
  Runtime& rt;
  std::unique_ptr<Runtime> helper = fake();
  Stream s, hs;
  Comm c, hc;
  Event e;
  int out = 7, in = 0;
  explicit Gate(Runtime& r) : rt(r) {
    s = rt.new_stream();
    hs = helper->new_stream();
    const UniqueId id = rt.new_id();
    c = rt.comm_init(id, 2, 0);
    hc = helper->comm_init(id, 2, 1);
    rt.send(&out, sizeof out, 1, c, s);
    e = mark(rt, s);
  }
  void open() { helper->recv(&in, sizeof in, 0, hc, hs); }
};

}  // namespace fastcomm::device::testing
