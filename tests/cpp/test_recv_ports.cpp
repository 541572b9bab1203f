// Receive ports (engine/group.h, RecvPort; matched in engine/progress.cpp): receives from any
// source and specific ones on one (group, tag) are matched in posting order, each taking its
// channel's next seq, so no receive takes a message an earlier one is owed and every
// channel's messages stay in order. Driven pass by pass over an in-memory transport.
#include <ATen/ATen.h>
#include <time.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/group.h"
#include "engine/progress.h"
#include "engine/router.h"
#include "fake_transport.h"
#include "transport/transport_set.h"
#include "unit.h"

using namespace fastcomm;

namespace {

constexpr int kTag = 3;

// Deadlines count from the coarse clock plus its resolution (engine/progress.cpp), so an op
// with a zero timeout is past its deadline once one resolution step has passed; two, to spare.
void pass_zero_timeouts() {
  timespec r{};
  clock_getres(CLOCK_MONOTONIC_COARSE, &r);
  std::this_thread::sleep_for(2 * (std::chrono::seconds(r.tv_sec) + std::chrono::nanoseconds(r.tv_nsec)));
}

// Rank 0 of a world of 3 receives on the group [0, 1, 2].
struct Fixture {
  TransportSet tr{3};
  FakeTransport* fake;
  GroupRegistry groups{1, 0, {0, 0, 0}, false};
  MessageRouter router{tr, groups};
  std::mutex mu;
  Progress progress{mu, 0, {100, 101, 102}, tr, router, [] {}};
  GroupHandle g;
  std::vector<uint64_t> sent = std::vector<uint64_t>(3, 0);  // messages each peer sent on kTag

  explicit Fixture(std::chrono::milliseconds timeout = std::chrono::milliseconds(60000)) {
    auto t = std::make_unique<FakeTransport>(3);
    fake = t.get();
    tr.add(std::move(t), {1, 1, 1});
    g = groups.create({{0, 1, 2}}, tr, timeout)[0];
  }

  // Peer `from` sends one float on kTag: its next message on the channel (from -> 0).
  void send(int from, float v) {
    Header h;
    h.group = groups.channel(g, from, 0, kTag).id;
    h.seq = sent[from]++;
    h.numel = 1;
    h.len = sizeof(float);
    h.kind = (uint8_t)OpKind::kSend;
    h.dtype = (uint8_t)c10::ScalarType::Float;
    fake->deliver(from, h, &v);
  }

  struct Recv {
    at::Tensor t;
    c10::intrusive_ptr<Work> w;
    float value() const { return t.item<float>(); }
  };

  // Posts a receive from `src` (kAnySource: any member), as the engine does.
  Recv post(int src) {
    Recv r;
    r.t = at::full({1}, -1.0f);
    const bool any = src == kAnySource;
    r.w = c10::make_intrusive<Work>(nullptr, 0, any ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV,
                                    std::vector<at::Tensor>{r.t}, 1, false);
    OpRequest req;
    req.kind = OpKind::kRecv;
    req.tensor = r.t;
    req.peer = src;
    req.tag = kTag;
    Progress::PostedOps ops;
    ops.emplace_back();
    ops[0].any_source = any;
    if (any) {
      ops[0].group = g.state.get();
      ops[0].op = std::make_unique<UnboundRecv>(req);
      ops[0].port = groups.port(g.state, kTag);
    } else {
      GroupHandle ch = groups.channel(g, src, 0, kTag);
      ops[0].group = ch.state.get();
      ops[0].op = collective_spec(OpKind::kRecv).make(req, view_of(*ch.state, 0, 0));
      ops[0].port = groups.find_port(g.id, kTag);
      r.w->set_source(src);
    }
    Progress::Done done;
    std::lock_guard<std::mutex> lk(mu);
    progress.post_locked(std::move(ops), r.w, done);
    return r;
  }

  void pass() {
    Progress::Done done;
    std::lock_guard<std::mutex> lk(mu);
    progress.pass_locked(done);
  }
  void health() {
    Progress::Done done;
    std::lock_guard<std::mutex> lk(mu);
    progress.health_locked(done);
  }
};

std::string error_of(const Work& w) {
  try {
    w.rethrow_if_failed();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ports_any_source_takes_the_first_message_here) {
  Fixture f;
  auto a = f.post(kAnySource);
  f.pass();
  CHECK(!a.w->done());
  f.send(2, 20.0f);
  f.pass();
  REQUIRE(a.w->done());
  CHECK_EQ(error_of(*a.w), std::string());
  CHECK_EQ(a.value(), 20.0f);
  CHECK_EQ(a.w->sourceRank(), 2);
}

TEST(ports_specific_receive_posted_first_keeps_its_message) {
  Fixture f;
  f.send(1, 10.0f);
  f.send(2, 20.0f);
  auto r = f.post(1);
  auto a = f.post(kAnySource);  // must leave rank 1's message to r
  f.pass();
  REQUIRE(r.w->done() && a.w->done());
  CHECK_EQ(r.value(), 10.0f);
  CHECK_EQ(a.value(), 20.0f);
  CHECK_EQ(a.w->sourceRank(), 2);
}

TEST(ports_specific_receive_posted_after_an_any_source_one_waits_behind_it) {
  Fixture f;
  auto a = f.post(kAnySource);
  auto r = f.post(1);
  f.send(1, 10.0f);  // owed to `a`, the earlier receive that accepts rank 1
  f.pass();
  CHECK(a.w->done());
  CHECK(!r.w->done());
  CHECK_EQ(a.value(), 10.0f);
  f.send(1, 11.0f);
  f.pass();
  REQUIRE(r.w->done());
  CHECK_EQ(r.value(), 11.0f);
}

TEST(ports_messages_already_here_match_in_posting_order) {
  Fixture f;
  for (int i = 0; i < 3; ++i) f.send(1, 10.0f + i);
  auto r0 = f.post(1);
  auto a = f.post(kAnySource);
  auto r2 = f.post(1);
  f.pass();
  f.pass();
  REQUIRE(r0.w->done() && a.w->done() && r2.w->done());
  CHECK_EQ(r0.value(), 10.0f);
  CHECK_EQ(a.value(), 11.0f);
  CHECK_EQ(r2.value(), 12.0f);
  CHECK_EQ(a.w->sourceRank(), 1);
}

TEST(ports_senders_take_turns_and_keep_their_order) {
  Fixture f;
  for (int i = 0; i < 3; ++i) {
    f.send(1, 10.0f + i);
    f.send(2, 20.0f + i);
  }
  std::vector<Fixture::Recv> rs;
  for (int i = 0; i < 6; ++i) rs.push_back(f.post(kAnySource));
  f.pass();
  std::vector<float> next = {0, 10.0f, 20.0f};
  std::vector<int> sources;
  for (auto& r : rs) {
    REQUIRE(r.w->done());
    const int s = r.w->sourceRank();
    sources.push_back(s);
    CHECK_EQ(r.value(), next[s]);
    next[s] += 1.0f;
  }
  CHECK(sources == std::vector<int>({1, 2, 1, 2, 1, 2}));  // neither sender starves the other
}

TEST(ports_timeout_fails_the_any_source_receive_only) {
  Fixture f(std::chrono::milliseconds(0));  // every op is past its deadline soon after posting
  auto a = f.post(kAnySource);
  auto r = f.post(1);
  f.pass();
  pass_zero_timeouts();
  f.health();
  REQUIRE(a.w->done());
  const std::string e = error_of(*a.w);
  CHECK(e.find("rank 0, group [0, 1, 2]: recv from any source (tag 3") != std::string::npos);
  CHECK(e.find("timed out") != std::string::npos);
  CHECK(!r.w->done());  // it now waits on its channel, bound at the next pass
  f.send(1, 10.0f);
  f.pass();
  REQUIRE(r.w->done());
  CHECK_EQ(error_of(*r.w), std::string());
  CHECK_EQ(r.value(), 10.0f);
}

TEST(ports_a_dead_member_fails_any_source_receives_after_its_messages_are_used) {
  Fixture f;
  f.send(2, 20.0f);
  f.fake->alive[2] = 0;  // exited right after sending
  auto a = f.post(kAnySource);  // matched by the eager pass, before anyone noticed
  auto b = f.post(kAnySource);
  f.health();
  REQUIRE(a.w->done() && b.w->done());
  CHECK_EQ(error_of(*a.w), std::string());
  CHECK_EQ(a.value(), 20.0f);
  const std::string e = error_of(*b.w);
  CHECK(e.find("rank 2 (pid 102) has exited") != std::string::npos);
  // A receive naming a live member still works; a new any-source one fails at once.
  auto r = f.post(1);
  f.send(1, 10.0f);
  f.pass();
  CHECK(r.w->done() && error_of(*r.w).empty());
  auto c = f.post(kAnySource);
  REQUIRE(c.w->done());
  CHECK(error_of(*c.w).find("cannot run: rank 2 (pid 102) has exited") != std::string::npos);
}

// Which of several exited members a rank notices first is a race; the message names them all.
TEST(ports_every_exited_member_is_named) {
  Fixture f;
  auto a = f.post(kAnySource);
  f.fake->alive[1] = 0;
  f.fake->alive[2] = 0;
  f.health();
  REQUIRE(a.w->done());
  CHECK(error_of(*a.w).find("rank 1 (pid 101) and rank 2 (pid 102) have exited") != std::string::npos);
}

TEST(ports_stop_fails_every_waiting_receive) {
  Fixture f;
  auto a = f.post(kAnySource);
  auto r = f.post(1);
  {
    Progress::Done done;
    std::lock_guard<std::mutex> lk(f.mu);
    f.progress.stop_locked(std::make_exception_ptr(std::runtime_error("stopped")), done);
  }
  CHECK(a.w->done() && r.w->done());
  CHECK_EQ(error_of(*r.w), std::string("stopped"));
}
