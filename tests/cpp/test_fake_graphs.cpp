// Unit tests of the fake runtime's CUDA graph model (device/fake_runtime.cpp, fake_streams.h):
// capture keeps stream work instead of running it, a replay runs it in order (streams that
// joined the capture included, communicators matched anew each time), and the calls CUDA refuses
// under capture are refused. One capture at a time in a process (the fake's limit), so two
// Runtimes of one communicator capture one after the other.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "device/runtime.h"
#include "fake_runtime.h"
#include "unit.h"

namespace {

using namespace fastcomm::device;
using namespace fastcomm::device::testing;

// Host-blocks until what is enqueued on `s` so far has run.
void drain(Runtime& rt, Stream s) {
  Event e = rt.new_event();
  rt.record(e, s);
  rt.synchronize(e);
  rt.destroy_event(e);
}

bool throws_with(const std::function<void()>& f, const std::string& part) {
  try {
    f();
  } catch (const std::exception& e) {
    const bool ok = std::string(e.what()).find(part) != std::string::npos;
    CHECK_MSG(ok, "raised '" << e.what() << "', wanted '" << part << "'");
    return ok;
  }
  CHECK_MSG(false, "nothing raised, wanted '" << part << "'");
  return false;
}

}  // namespace

// Captured work does not run; each replay runs it in order, reading its buffers in place, and
// a stream forked by an event and joined back runs its part between.
TEST(fake_graph_capture_records_and_replays_in_order) {
  auto rt = fake();
  Stream origin = rt->new_stream(), side = rt->new_stream(), launch = rt->new_stream();
  int a = 1, b = 0, c = 0, d = 0;
  rt->begin_capture(origin);
  CHECK(rt->capturing(origin));
  CHECK(!rt->capturing(side));
  rt->copy(&b, &a, sizeof a, origin);  // b = a
  Event fork = rt->new_event(), join = rt->new_event();
  rt->record(fork, origin);
  rt->wait(side, fork);  // side joins the capture
  CHECK(rt->capturing(side));
  rt->copy(&c, &b, sizeof b, side);  // c = b, after the copy above
  rt->record(join, side);
  rt->wait(origin, join);
  rt->copy(&d, &c, sizeof c, origin);  // d = c, after side's copy
  void* g = rt->end_capture(origin);
  CHECK(!rt->capturing(origin));
  CHECK(!rt->capturing(side));
  drain(*rt, origin);
  drain(*rt, side);
  CHECK_EQ(b + c + d, 0);  // nothing ran at capture
  for (int i = 1; i <= 5; ++i) {
    a = 10 * i;
    rt->graph_launch(g, launch);
    drain(*rt, launch);
    CHECK_EQ(b, 10 * i);
    CHECK_EQ(c, 10 * i);
    CHECK_EQ(d, 10 * i);
  }
  rt->graph_destroy(g);
  rt->destroy_event(fork);
  rt->destroy_event(join);
}

// A pair's captured send and receive match anew at every replay: the communicator numbers them
// at each run, so eager traffic between replays does not shift them.
TEST(fake_graph_communicators_match_anew_each_replay) {
  std::vector<std::unique_ptr<Runtime>> rt;
  rt.push_back(fake());
  rt.push_back(fake());
  const UniqueId id = rt[0]->new_id();
  Comm comm[2] = {rt[0]->comm_init(id, 2, 0), rt[1]->comm_init(id, 2, 1)};
  REQUIRE(eventually([&] {
    return rt[0]->comm_state(comm[0], nullptr) == State::kReady && rt[1]->comm_state(comm[1], nullptr) == State::kReady;
  }));
  Stream s[2] = {rt[0]->new_stream(), rt[1]->new_stream()};
  Stream origin[2] = {rt[0]->new_stream(), rt[1]->new_stream()};
  int in[2] = {0, 0}, out[2] = {-1, -1};
  void* g[2];
  for (int r = 0; r < 2; ++r) {  // one capture at a time in a process
    rt[r]->begin_capture(origin[r]);
    Event f = rt[r]->new_event(), j = rt[r]->new_event();
    rt[r]->record(f, origin[r]);
    rt[r]->wait(s[r], f);
    rt[r]->group_start();
    rt[r]->send(&in[r], sizeof(int), 1 - r, comm[r], s[r]);
    rt[r]->recv(&out[r], sizeof(int), 1 - r, comm[r], s[r]);
    rt[r]->group_end();
    rt[r]->record(j, s[r]);
    rt[r]->wait(origin[r], j);
    g[r] = rt[r]->end_capture(origin[r]);
    rt[r]->destroy_event(f);
    rt[r]->destroy_event(j);
  }
  CHECK_EQ(out[0], -1);
  for (int i = 0; i < 4; ++i) {
    in[0] = 100 + i;
    in[1] = 200 + i;
    for (int r = 0; r < 2; ++r) rt[r]->graph_launch(g[r], rt[r]->current_stream());
    for (int r = 0; r < 2; ++r) drain(*rt[r], rt[r]->current_stream());
    CHECK_EQ(out[0], 200 + i);
    CHECK_EQ(out[1], 100 + i);
    // an eager exchange between replays, on the same communicators
    int x = 7, y = 0;
    rt[0]->send(&x, sizeof x, 1, comm[0], s[0]);
    rt[1]->recv(&y, sizeof y, 0, comm[1], s[1]);
    drain(*rt[1], s[1]);
    CHECK_EQ(y, 7);
  }
  for (int r = 0; r < 2; ++r) rt[r]->graph_destroy(g[r]);
}

// What CUDA refuses under capture, the fake refuses: host waits on captured work, allocation
// for (or by) the capture, a captured stream waiting on outside work, and a stream that joined
// but was not joined back.
TEST(fake_graph_refuses_what_cuda_refuses_under_capture) {
  auto rt = fake();
  Stream origin = rt->new_stream(), side = rt->new_stream(), other = rt->new_stream();
  at::Tensor like = at::zeros({4});
  Event outside = rt->new_event();
  rt->record(outside, other);
  drain(*rt, other);

  rt->begin_capture(origin);
  Event e = rt->new_event();
  rt->record(e, origin);
  CHECK(throws_with([&] { rt->synchronize(e); }, "captured into a CUDA graph"));
  CHECK(throws_with([&] { rt->query(e); }, "captured into a CUDA graph"));
  CHECK(throws_with([&] { rt->scratch(4, like, origin); }, "allocation"));
  CHECK(throws_with([&] { rt->wait(origin, outside); }, "outside the capture"));
  CHECK(throws_with([&] { rt->end_capture(origin); }, "invalidated"));  // the wait invalidated it

  rt->begin_capture(origin);  // the capturing thread's own sync is potentially unsafe
  CHECK(throws_with([&] { rt->synchronize(outside); }, "not permitted when stream is capturing"));
  CHECK(throws_with([&] { rt->end_capture(origin); }, "invalidated"));

  rt->begin_capture(origin);
  rt->record(e, origin);
  rt->wait(side, e);
  int x = 1, y = 0;
  rt->copy(&y, &x, sizeof x, side);  // side is never joined back
  CHECK(throws_with([&] { rt->end_capture(origin); }, "Unjoined"));
  CHECK(!rt->capturing(side));
  // a wait on an event whose record is in a capture that ended
  CHECK(throws_with([&] { rt->wait(other, e); }, "capture has ended"));
  drain(*rt, side);
  CHECK_EQ(y, 0);  // the refused graph never ran
  rt->destroy_event(e);
  rt->destroy_event(outside);
}

// A graph is launched, not captured: a launch into a capture is refused and invalidates it (so
// a plan's graph reaches a larger graph only as its work recorded anew). A host call under
// capture is a node: it runs at each replay, in its stream's order, not at the call.
TEST(fake_graph_refuses_a_launch_into_a_capture_and_keeps_host_calls_as_nodes) {
  auto rt = fake();
  Stream origin = rt->new_stream(), inner_origin = rt->new_stream(), launch = rt->new_stream();
  int a = 5, b = 0;
  rt->begin_capture(inner_origin);
  rt->copy(&b, &a, sizeof a, inner_origin);
  void* inner = rt->end_capture(inner_origin);

  rt->begin_capture(origin);
  CHECK(throws_with([&] { rt->graph_launch(inner, origin); }, "cannot be launched into a stream capture"));
  CHECK(throws_with([&] { rt->end_capture(origin); }, "invalidated"));
  drain(*rt, origin);
  CHECK_EQ(b, 0);  // the refused launch ran nothing

  struct Count {
    std::atomic<int> n{0};
    int seen_b = -1;  // b when the call ran: the copy before it had run
    int* b = nullptr;
  } count;
  count.b = &b;
  auto tick = [](void* p) {
    auto* c = static_cast<Count*>(p);
    c->seen_b = *c->b;
    ++c->n;
  };
  rt->begin_capture(origin);
  rt->copy(&b, &a, sizeof a, origin);
  rt->host_call(origin, tick, &count);
  void* g = rt->end_capture(origin);
  drain(*rt, origin);
  CHECK_EQ(count.n.load(), 0);  // captured, not run
  for (int i = 1; i <= 3; ++i) {
    b = 0;
    rt->graph_launch(g, launch);
    drain(*rt, launch);
    CHECK_EQ(count.n.load(), i);
    CHECK_EQ(count.seen_b, 5);
  }
  rt->host_call(launch, tick, &count);  // outside a capture: runs in its stream's order
  drain(*rt, launch);
  CHECK_EQ(count.n.load(), 4);
  rt->graph_destroy(g);
  rt->graph_destroy(inner);
}
