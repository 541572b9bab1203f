// Unit tests of eager IPC links (device/ipc_link.h) on the fake runtime: both sides of a pair in
// one process, each side's chunks enqueued by pump() as the other side's host lets them go, and
// one side's stream held back by a gate, so what a stream waits for shows.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "device/ipc_link.h"
#include "device/runtime.h"
#include "fake_runtime.h"
#include "unit.h"

namespace {

using namespace fastcomm::device;
using namespace fastcomm::device::testing;

// Bytes that differ from one 256-byte chunk to the next.
void fill(std::vector<uint8_t>& v, int seed) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = (uint8_t)((seed * 31 + i * 7 + (i >> 8) * 13) & 0xff);
}

// A slot's flags hold its use modulo 2^32 (the stream waits compare cyclically); a link whose
// slots pass their 2^32-th use must still wait for room: side a sends 12 chunks through 4 slots
// of 256 bytes whose next use is the (2^32 - 1)-th, so chunks 4-11 reuse slots side b has not
// read while its stream is held, and those uses are 2^32 and 2^32 + 1 (0 and 1 in the flags).
void wrap_case(size_t fuse_bytes) {
  auto rt = fake();
  IpcLink a{*rt, 1, 0, 1024, 4, /*host=*/false};
  IpcLink b{*rt, 0, 0, 1024, 4, /*host=*/false};
  a.fuse_bytes = b.fuse_bytes = fuse_bytes;
  a.open_peer(b.id());
  b.open_peer(a.id());
  const uint64_t start = 4 * ((uint64_t{1} << 32) - 2);
  a.start_at(start);
  b.start_at(start);
  std::vector<uint8_t> src(12 * 256), dst(12 * 256, 0);
  fill(src, 5);
  Gate gate(*rt);  // side b's stream: its receives run once the gate opens
  Stream sa = rt->new_stream();
  Part send, recv;
  send.sends.push_back({src.data(), src.size()});
  recv.recvs.push_back({dst.data(), dst.size()});
  a.add(send, sa);
  b.add(recv, gate.s);
  const bool enqueued = eventually([&] {
    a.pump();
    b.pump();
    return !a.pending() && !b.pending();
  });
  REQUIRE(enqueued);
  const Event ea = mark(*rt, sa);
  CHECK_MSG(stays([&] { return !ready(*rt, ea); }), "fuse " << fuse_bytes << ": sends overwrote unread slots");
  gate.open();
  const Event eb = mark(*rt, gate.s);
  REQUIRE(eventually([&] { return ready(*rt, ea) && ready(*rt, eb); }));
  CHECK_MSG(dst == src, "fuse " << fuse_bytes << ": the data arrived wrong");
  a.abort();
  b.abort();
  a.close_peer();
  b.close_peer();
}

// The same link, ended by the sender while its sends wait for room at uses 2^32 and 2^32 + 1
// (the flags' 0 and 1): ending releases every wait, so its stream drains, and the peer is told
// that what it receives from then on may be garbage.
void wrap_abort_case() {
  auto rt = fake();
  IpcLink a{*rt, 1, 0, 1024, 4, /*host=*/false};
  IpcLink b{*rt, 0, 0, 1024, 4, /*host=*/false};
  a.open_peer(b.id());
  b.open_peer(a.id());
  const uint64_t start = 4 * ((uint64_t{1} << 32) - 2);
  a.start_at(start);
  b.start_at(start);
  std::vector<uint8_t> src(12 * 256), dst(12 * 256, 0);
  Gate gate(*rt);
  Stream sa = rt->new_stream();
  Part send, recv;
  send.sends.push_back({src.data(), src.size()});
  recv.recvs.push_back({dst.data(), dst.size()});
  a.add(send, sa);
  b.add(recv, gate.s);
  REQUIRE(eventually([&] {
    a.pump();
    b.pump();
    return !a.pending() && !b.pending();
  }));
  const Event ea = mark(*rt, sa);
  CHECK(stays([&] { return !ready(*rt, ea); }));
  a.abort();
  CHECK_MSG(eventually([&] { return ready(*rt, ea); }), "the sender's stream did not drain once its waits were released");
  CHECK(b.peer_garbage());
  gate.open();
  const Event eb = mark(*rt, gate.s);
  REQUIRE(eventually([&] {
    b.abort();
    return ready(*rt, eb);
  }));
  a.close_peer();
  b.close_peer();
}

TEST(ipc_link_slot_uses_past_two_to_the_32_still_wait_for_room) {
  wrap_case(0);
  wrap_case(16384);
  wrap_abort_case();
}

}  // namespace
