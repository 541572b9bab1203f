// Unit tests of fixed IPC links (device/ipc_link.h, "A link for CUDA graphs") on the fake
// runtime: both sides of a pair in one process, each side's transfers captured into a graph of
// its own and the two graphs launched in scripted orders. A run leaves every flag as it began,
// so the same graphs replay; a side launched twice before its peer starts waits for it; a side
// whose peer never runs drains once its link ends and its waits are released, and the peer is
// told.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "device/ipc_link.h"
#include "device/runtime.h"
#include "fake_runtime.h"
#include "unit.h"

namespace {

using namespace fastcomm::device;
using namespace fastcomm::device::testing;

void fill(std::vector<uint8_t>& v, int seed) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = (uint8_t)((seed * 31 + i * 7) & 0xff);
}

Part part(std::vector<uint8_t>& out, std::vector<uint8_t>& in) {
  Part p;
  if (!out.empty()) p.sends.push_back({out.data(), out.size()});
  if (!in.empty()) p.recvs.push_back({in.data(), in.size()});
  return p;
}

// Two fixed links of one pair, 4 slots of 256 bytes each way, and one side's transfers
// captured per graph (one capture at a time in a process: the fake's limit).
struct Pair {
  std::unique_ptr<Runtime> rt = fake();
  IpcLink a{*rt, 1, 0, 1024, 4, /*host=*/false, /*fixed=*/true};
  IpcLink b{*rt, 0, 0, 1024, 4, /*host=*/false, /*fixed=*/true};
  Stream ca = rt->new_stream(), cb = rt->new_stream(), la = rt->new_stream(), lb = rt->new_stream();
  void* ga = nullptr;
  void* gb = nullptr;

  Pair() {
    a.open_peer(b.id());
    b.open_peer(a.id());
  }
  void capture(const Part& pa, const Part& pb) {
    a.restart_fixed();
    rt->begin_capture(ca);
    a.emit_fixed(pa, ca);
    ga = rt->end_capture(ca);
    b.restart_fixed();
    rt->begin_capture(cb);
    b.emit_fixed(pb, cb);
    gb = rt->end_capture(cb);
  }
  // Runs still waiting (a test that failed) drain first, as a failed plan's do.
  ~Pair() {
    a.end_fixed(/*failed=*/true);
    b.end_fixed(/*failed=*/true);
    eventually([&] {
      a.release_fixed();
      b.release_fixed();
      Event ea = mark(*rt, la), eb = mark(*rt, lb);
      const bool idle = ready(*rt, ea) && ready(*rt, eb);
      rt->destroy_event(ea);
      rt->destroy_event(eb);
      return idle;
    });
    for (void* g : {ga, gb})
      if (g) rt->graph_destroy(g);
  }
};

}  // namespace

// Sizes that wrap the ring several times, unequal between the directions (one side sends 12
// chunks and receives 3): each run moves the data, whichever side is launched first, and the
// next run of the same graphs finds the flags as the first did.
TEST(fixed_link_graphs_replay_in_either_launch_order) {
  std::vector<uint8_t> src_a(3000), dst_a(700), src_b(700), dst_b(3000);
  Pair k;  // after the buffers: its end drains runs that may still write them
  k.capture(part(src_a, dst_a), part(src_b, dst_b));
  CHECK(dst_a == std::vector<uint8_t>(700, 0));  // captured, not run
  for (int r = 0; r < 6; ++r) {
    fill(src_a, r);
    fill(src_b, 100 + r);
    if (r % 2 == 0) {
      k.rt->graph_launch(k.ga, k.la);
      k.rt->graph_launch(k.gb, k.lb);
    } else {
      k.rt->graph_launch(k.gb, k.lb);
      k.rt->graph_launch(k.ga, k.la);
    }
    Event ea = mark(*k.rt, k.la), eb = mark(*k.rt, k.lb);
    const bool finished = eventually([&] { return ready(*k.rt, ea) && ready(*k.rt, eb); });
    CHECK_MSG(finished, "run " << r << " did not finish");
    if (!finished) return;
    CHECK_MSG(dst_a == src_b, "run " << r);
    CHECK_MSG(dst_b == src_a, "run " << r);
  }
}

// One side queues two runs before the other launches anything: its first run waits for the
// peer (nothing moves), its second waits for its first, and each of the peer's runs gets the
// data of the matching run (the source is refilled on the stream between the two).
TEST(fixed_link_two_runs_queued_before_the_peer_starts) {
  std::vector<uint8_t> src_a(2000), dst_a(2000), src_b(2000), dst_b(2000), next(2000), first(2000);
  Pair k;  // after the buffers: its end drains runs that may still write them
  k.capture(part(src_a, dst_a), part(src_b, dst_b));
  fill(src_a, 1);
  fill(next, 2);
  fill(src_b, 3);
  k.rt->graph_launch(k.ga, k.la);
  k.rt->copy(src_a.data(), next.data(), next.size(), k.la);  // after run 1 of side a
  k.rt->graph_launch(k.ga, k.la);
  Event ea = mark(*k.rt, k.la);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(!ready(*k.rt, ea));
  CHECK(dst_a == std::vector<uint8_t>(2000, 0));
  std::vector<uint8_t> want_first = src_a;
  k.rt->graph_launch(k.gb, k.lb);
  k.rt->copy(first.data(), dst_b.data(), dst_b.size(), k.lb);
  k.rt->graph_launch(k.gb, k.lb);
  Event eb = mark(*k.rt, k.lb);
  REQUIRE(eventually([&] { return ready(*k.rt, ea) && ready(*k.rt, eb); }));
  CHECK(first == want_first);
  CHECK(dst_b == next);
  CHECK(dst_a == src_b);
}

// A side whose peer never runs: its run waits; once its link ends as failed and its waits are
// released (again and again, as a failed plan's drain does: the run's own clears block later
// waits anew), the run goes to its end, and the peer sees the link ended with garbage.
TEST(fixed_link_failed_side_drains_and_tells_the_peer) {
  std::vector<uint8_t> src_a(2000), dst_a(2000), src_b(2000), dst_b(2000);
  Pair k;  // after the buffers: its end drains runs that may still write them
  k.capture(part(src_a, dst_a), part(src_b, dst_b));
  k.rt->graph_launch(k.ga, k.la);
  Event ea = mark(*k.rt, k.la);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  CHECK(!ready(*k.rt, ea));
  CHECK(!k.b.peer_ended());
  CHECK(!k.b.peer_garbage());
  k.a.end_fixed(/*failed=*/true);
  CHECK(k.b.peer_ended());
  CHECK(k.b.peer_garbage());
  CHECK(eventually([&] {
    k.a.release_fixed();
    return ready(*k.rt, ea);
  }));
}

// A link ended cleanly (its runs over) tells the peer it ended, not that its data is garbage.
TEST(fixed_link_clean_end_is_no_garbage) {
  std::vector<uint8_t> src_a(100), dst_a(100), src_b(100), dst_b(100);
  Pair k;  // after the buffers: its end drains runs that may still write them
  k.capture(part(src_a, dst_a), part(src_b, dst_b));
  fill(src_a, 5);
  fill(src_b, 6);
  k.rt->graph_launch(k.ga, k.la);
  k.rt->graph_launch(k.gb, k.lb);
  Event ea = mark(*k.rt, k.la), eb = mark(*k.rt, k.lb);
  REQUIRE(eventually([&] { return ready(*k.rt, ea) && ready(*k.rt, eb); }));
  CHECK(dst_b == src_a);
  k.a.end_fixed(/*failed=*/false);
  CHECK(k.b.peer_ended());
  CHECK(!k.b.peer_garbage());
}
