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

// Side a sends 12 chunks to side b through 4 slots of 256 bytes each way, every slot's next use
// the (2^32 - 1)-th: chunks 4-11 reuse slots, at uses 2^32 and 2^32 + 1 (0 and 1 in the flags,
// which hold a slot's use modulo 2^32 and are compared cyclically). Side b's stream is held by a
// gate, so nothing it receives is read until the gate opens. Everything is enqueued on both
// sides when the constructor returns; `sent` is an event behind side a's sends.
struct WrapPair {
  std::unique_ptr<Runtime> rt = fake();
  IpcLink a{*rt, 1, 0, 1024, 4, /*host=*/false};
  IpcLink b{*rt, 0, 0, 1024, 4, /*host=*/false};
  std::vector<uint8_t> src = std::vector<uint8_t>(12 * 256), dst = std::vector<uint8_t>(12 * 256, 0);
  Gate gate{*rt};
  Stream sa = rt->new_stream();
  Event sent = nullptr;

  explicit WrapPair(size_t fuse_bytes) {
    a.fuse_bytes = b.fuse_bytes = fuse_bytes;
    a.open_peer(b.id());
    b.open_peer(a.id());
    const uint64_t start = 4 * ((uint64_t{1} << 32) - 2);
    a.start_at(start);
    b.start_at(start);
    fill(src, 5);
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
    CHECK_MSG(enqueued, "the chunks were not all enqueued");
    sent = mark(*rt, sa);
  }
  // b's stream drained (its waits released by abort() where a side ended its link).
  bool received() {
    gate.open();
    const Event eb = mark(*rt, gate.s);
    return eventually([&] {
      if (b.peer_garbage()) b.abort();
      return ready(*rt, eb);
    });
  }
  ~WrapPair() {
    a.abort();
    b.abort();
    a.close_peer();
    b.close_peer();
  }
};

// Sends that reuse a slot past its 2^32-th use still wait for room: side a's stream stays held
// until b has read the slots, and the data arrives whole.
void wrap_case(size_t fuse_bytes) {
  WrapPair k(fuse_bytes);
  CHECK_MSG(stays([&] { return !ready(*k.rt, k.sent); }), "fuse " << fuse_bytes << ": sends overwrote unread slots");
  REQUIRE(k.received());
  REQUIRE(eventually([&] { return ready(*k.rt, k.sent); }));
  CHECK_MSG(k.dst == k.src, "fuse " << fuse_bytes << ": the data arrived wrong");
}

// Ending the sender's side while its sends wait for room at those uses releases every wait, so
// its stream drains, and the peer is told that what it receives from then on may be garbage.
void wrap_abort_case() {
  WrapPair k(0);
  CHECK(stays([&] { return !ready(*k.rt, k.sent); }));
  k.a.abort();
  CHECK_MSG(eventually([&] { return ready(*k.rt, k.sent); }), "the sender's stream did not drain once its waits were released");
  CHECK(k.b.peer_garbage());
  REQUIRE(k.received());
}

TEST(ipc_link_slot_uses_past_two_to_the_32_still_wait_for_room) {
  wrap_case(0);
  wrap_case(16384);
  wrap_abort_case();
}

}  // namespace
