// The message router (engine/router.h): an op reads only its own messages from a peer's
// stream; others' are stashed and replayed in arrival order, finished ops' are dropped, and
// dropped bulk offers are drained.
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "engine/group.h"
#include "engine/router.h"
#include "fake_transport.h"
#include "transport/transport_set.h"
#include "unit.h"

using namespace fastcomm;

namespace {

std::string text(const Message* m) {
  return m ? std::string(reinterpret_cast<const char*>(m->data), m->hdr.len) : std::string("<none>");
}

// Rank 0 of a world of 3, every rank reached through one fake transport; two groups over the
// same ranks (so different ids) and one over [0, 2].
struct Fixture {
  TransportSet tr{3};
  FakeTransport* fake;
  GroupRegistry groups{1, 0, {0, 0, 0}, true};
  MessageRouter router{tr, groups};
  GroupHandle a, b, c;

  Fixture() {
    auto t = std::make_unique<FakeTransport>(3);
    fake = t.get();
    tr.add(std::move(t), {1, 1, 1});
    auto made = groups.create({{0, 1}, {0, 1}, {0, 2}}, tr, std::chrono::milliseconds(1000));
    a = made[0];
    b = made[1];
    c = made[2];
  }
};

}  // namespace

TEST(router_reads_own_message_and_stashes_others) {
  Fixture f;
  CHECK(f.a.id != f.b.id);
  f.fake->deliver(1, f.b.id, 0, 1, "b0");
  f.fake->deliver(1, f.a.id, 0, 2, "a0");
  const Message* m = f.router.peek(*f.a.state, 0, 1);
  CHECK_EQ(text(m), std::string("a0"));
  CHECK_EQ(f.router.stashed(), 1u);
  f.router.pop(*f.a.state, 0, 1);
  // b's op finds its message in the stash, intact, after the stream moved on.
  const Message* mb = f.router.peek(*f.b.state, 0, 1);
  CHECK_EQ(text(mb), std::string("b0"));
  CHECK_EQ(mb ? mb->hdr.tag : 0u, 1u);
  f.router.pop(*f.b.state, 0, 1);
  CHECK_EQ(f.router.stashed(), 0u);
  CHECK(f.router.peek(*f.b.state, 0, 1) == nullptr);
}

TEST(router_replays_stash_in_arrival_order) {
  Fixture f;
  for (int i = 0; i < 5; ++i) f.fake->deliver(1, f.b.id, 3, i, "b" + std::to_string(i));
  f.fake->deliver(1, f.a.id, 0, 0, "a0");
  CHECK_EQ(text(f.router.peek(*f.a.state, 0, 1)), std::string("a0"));
  CHECK_EQ(f.router.stashed(), 5u);
  for (int i = 0; i < 5; ++i) {
    CHECK_EQ(text(f.router.peek(*f.b.state, 3, 1)), "b" + std::to_string(i));
    f.router.pop(*f.b.state, 3, 1);
  }
  CHECK_EQ(f.router.stashed(), 0u);
}

TEST(router_without_scan_reads_past_nothing) {
  Fixture f;
  f.fake->deliver(1, f.b.id, 0, 0, "b0");
  f.fake->deliver(1, f.a.id, 0, 0, "a0");
  CHECK(f.router.peek(*f.a.state, 0, 1, /*scan=*/false) == nullptr);
  CHECK_EQ(f.router.stashed(), 0u);
  CHECK_EQ(f.fake->in[1].size(), 2u);
}

TEST(router_keeps_peers_apart) {
  Fixture f;
  f.fake->deliver(2, f.c.id, 0, 0, "from2");
  f.fake->deliver(1, f.a.id, 0, 0, "from1");
  CHECK_EQ(text(f.router.peek(*f.c.state, 0, 2)), std::string("from2"));
  CHECK_EQ(text(f.router.peek(*f.a.state, 0, 1)), std::string("from1"));
  CHECK(f.router.peek(*f.c.state, 0, 1) == nullptr);  // peer 1 holds nothing of c's (and it is stashed)
  CHECK_EQ(f.router.stashed(), 1u);
}

TEST(router_drops_messages_of_finished_ops) {
  Fixture f;
  f.a.state->head_seq = 2;  // ops 0 and 1 of `a` finished (or failed) here
  f.fake->deliver(1, f.a.id, 0, 7, "stale0");
  f.fake->deliver(1, f.a.id, 1, 8, "stale1", kMsgBulk);
  f.fake->deliver(1, f.a.id, 2, 9, "live");
  CHECK_EQ(text(f.router.peek(*f.a.state, 2, 1)), std::string("live"));
  CHECK_EQ(f.router.stashed(), 0u);
  REQUIRE_EQ(f.fake->drained.size(), 1u);  // the stale bulk offer is received into nothing
  CHECK_EQ(f.fake->drained[0], 8u);
}

TEST(router_drop_stale_clears_stream_heads_only) {
  Fixture f;
  f.a.state->head_seq = 1;
  f.fake->deliver(1, f.a.id, 0, 1, "stale", kMsgBulk);
  f.fake->deliver(1, f.b.id, 0, 2, "other");
  f.fake->deliver(1, f.a.id, 0, 3, "stale-behind");
  CHECK(f.router.drop_stale(*f.a.state, 0));
  CHECK_EQ(f.fake->in[1].size(), 2u);  // stops at the first live message
  CHECK_EQ(f.fake->drained.size(), 1u);
  CHECK(!f.router.drop_stale(*f.a.state, 0));
}

TEST(router_purge_drops_a_failed_ops_stash) {
  Fixture f;
  f.fake->deliver(1, f.b.id, 4, 1, "b4-offer", kMsgBulk);
  f.fake->deliver(1, f.b.id, 4, 2, "b4");
  f.fake->deliver(1, f.b.id, 5, 3, "b5");
  f.fake->deliver(1, f.a.id, 0, 0, "a0");
  CHECK_EQ(text(f.router.peek(*f.a.state, 0, 1)), std::string("a0"));
  CHECK_EQ(f.router.stashed(), 3u);
  f.router.purge(*f.b.state, 4);
  CHECK_EQ(f.router.stashed(), 1u);
  CHECK_EQ(f.fake->drained.size(), 1u);
  CHECK_EQ(text(f.router.peek(*f.b.state, 5, 1)), std::string("b5"));
}

TEST(router_discarding_pop_drains_offers) {
  Fixture f;
  f.fake->deliver(1, f.b.id, 0, 5, "offer", kMsgBulk);
  f.fake->deliver(1, f.a.id, 0, 6, "head-offer", kMsgBulk);
  CHECK_EQ(text(f.router.peek(*f.a.state, 0, 1)), std::string("head-offer"));
  f.router.pop(*f.a.state, 0, 1, /*discard=*/true);  // from the stream
  CHECK_EQ(text(f.router.peek(*f.b.state, 0, 1)), std::string("offer"));
  f.router.pop(*f.b.state, 0, 1, /*discard=*/true);  // from the stash
  REQUIRE_EQ(f.fake->drained.size(), 2u);
  CHECK_EQ(f.fake->drained[0], 6u);
  CHECK_EQ(f.fake->drained[1], 5u);
  CHECK_EQ(f.router.stashed(), 0u);
  CHECK(f.fake->in[1].empty());
}
