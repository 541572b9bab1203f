// Unit tests of receives from any source on the device path: the receive ports
// (device/recv_ports.h) over the pair agreements (device/agreement.h) of a receiver and its
// candidate senders, with the frames between them delivered one at a time in the order each
// test chooses (scripted, or drawn from a seeded generator).
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "device/agreement.h"
#include "device/recv_ports.h"
#include "unit.h"

using namespace fastcomm::device;
using fastcomm::DeviceOp;
using fastcomm::OpKind;

namespace {

using Why = PairAgreement::Why;

Sig sig(OpKind k, uint64_t bytes) {
  Sig s;
  s.kind = (uint8_t)k;
  s.dtype = 6;  // float
  s.bytes = bytes;
  return s;
}

// Every side's name for an item is its key: id * 100 + seq, the same on both sides of a pair.
intptr_t name(const Key& k) { return (intptr_t)(k.id * 100 + k.seq); }

// Ranks and their pair agreements (the lower rank leads), with the frames between them.
struct Net {
  struct Side {
    explicit Side(bool leader) : m(leader) {}
    PairAgreement m;
    std::deque<Frame> out;
    std::vector<intptr_t> launched;
    std::vector<std::pair<intptr_t, Why>> failed;
  };
  std::map<std::pair<int, int>, std::unique_ptr<Side>> sides;  // (me, peer)

  Side& side(int me, int peer) {
    auto& s = sides[{me, peer}];
    if (!s) s = std::make_unique<Side>(me < peer);
    return *s;
  }
  void take(Side& s, PairAgreement::Out& o) {
    for (void* t : o.launch) s.launched.push_back((intptr_t)t);
    for (auto& f : o.failed) s.failed.push_back({(intptr_t)f.token, f.why});
    for (auto& f : o.frames) s.out.push_back(f);
    o.clear();
  }
  void ready(int me, int peer, const Key& k, const Sig& s) {
    PairAgreement::Out o;
    side(me, peer).m.ready(Item{k, s, false, (void*)name(k)}, o);
    take(side(me, peer), o);
  }
  // A send of `me`'s to `peer` on channel `id`, numbered `seq` there.
  void send(int me, int peer, uint64_t id, uint64_t seq, uint64_t bytes = 8) {
    ready(me, peer, Key{id, seq}, sig(OpKind::kSend, bytes));
  }
  void flush(int me, int peer) {
    PairAgreement::Out o;
    side(me, peer).m.flush(o);
    take(side(me, peer), o);
  }
  // Delivers up to n frames `from` sent to `to`; how many it delivered.
  int deliver(int from, int to, int n = -1) {
    Side& s = side(from, to);
    int done = 0;
    while (n != 0 && !s.out.empty()) {
      Frame f = s.out.front();
      s.out.pop_front();
      PairAgreement::Out o;
      side(to, from).m.receive(f, o);
      take(side(to, from), o);
      --n;
      ++done;
    }
    return done;
  }
  void settle() {
    for (bool moved = true; moved;) {
      moved = false;
      for (auto& [k, s] : sides) {
        flush(k.first, k.second);
        moved = deliver(k.first, k.second) > 0 || moved;
      }
    }
  }
  bool failed_with(int me, int peer, intptr_t n, Why why) {
    for (auto& [x, w] : side(me, peer).failed)
      if (x == n && w == why) return true;
    return false;
  }
};

// The receiver: its ports over the net's agreements, its recvs numbered at post as the engine
// numbers them (RecvNumbers); a bound recv is made ready at once (its channel's previous op is
// taken to be enqueued).
struct Receiver final : RecvPorts::Channels {
  Receiver(Net& n, int r) : net(n), me(r) {}
  Net& net;
  int me;
  RecvPorts ports;
  RecvNumbers numbers;
  std::unordered_map<uint64_t, uint64_t>& next_seq = numbers.next_seq();
  std::set<int> dead;
  std::map<intptr_t, Key> bound;       // recv token -> the key it took
  std::map<intptr_t, int> bound_from;  // ... and its sender's group rank
  std::map<intptr_t, int> failures;    // recv token -> the candidate named
  std::map<intptr_t, uint64_t> bytes;

  void watch(int rank, const Key& k) override { net.side(me, rank).m.watch(k); }
  void unwatch(int rank, const Key& k) override { net.side(me, rank).m.unwatch(k); }
  bool offered(int rank, const Key& k) override { return net.side(me, rank).m.offered(k); }
  bool failed(int rank) override { return dead.count(rank) > 0; }

  // A recv on port (group 1, `tag`): numbered now, or queued on the port (ChannelEngine::post).
  void post(intptr_t token, const std::vector<DeviceOp::Sender>& from, bool any, uint64_t b = 8, int64_t tag = 0) {
    bytes[token] = b;
    const PortKey port{1, tag};
    Key k;
    if (numbers.take(from[0].id, &port, any, k)) {
      bind(token, from[0], k);
      return;
    }
    ports.post(port, RecvPorts::Recv{(void*)token, any, from});
    tags[token] = tag;
  }
  void step() {
    std::vector<RecvPorts::Bound> b;
    std::vector<RecvPorts::Failed> f;
    ports.step(*this, next_seq, b, f);
    for (auto& x : b) {
      numbers.settled({1, tags[(intptr_t)x.token]});
      bind((intptr_t)x.token, x.from, x.key);
    }
    for (auto& x : f) {
      numbers.settled({1, tags[(intptr_t)x.token]});
      failures[(intptr_t)x.token] = x.rank;
    }
  }
  void bind(intptr_t t, const DeviceOp::Sender& from, const Key& k) {
    bound[t] = k;
    bound_from[t] = from.group_rank;
    net.ready(me, from.rank, k, sig(OpKind::kRecv, bytes[t]));
  }
  std::map<intptr_t, int64_t> tags;  // unbound recvs' ports
};

// Group {0, 1, 2}; rank 1 receives. Rank 0 leads its pair with 1 (its proposals reach 1), rank
// 2 follows (1 probes it). Channels (group, j -> 1, tag): 10 from rank 0, 20 from rank 2.
const DeviceOp::Sender kFrom0{0, 0, 10}, kFrom2{2, 2, 20};
const std::vector<DeviceOp::Sender> kAny{kFrom0, kFrom2};

}  // namespace

// Rank 0's proposal reaches the receiver first: the recv binds to it; rank 2's send, probed
// meanwhile, stays ready and goes to the next recv from any source.
TEST(any_source_two_senders_race_leader_first) {
  Net net;
  Receiver r(net, 1);
  r.post(1, kAny, true);
  r.post(2, kAny, true);
  r.step();
  CHECK(r.bound.empty());
  CHECK(net.side(1, 2).m.waiting());  // the probe awaits its answer
  net.send(0, 1, 10, 0);
  net.flush(0, 1);
  net.send(2, 1, 20, 0);
  net.flush(1, 2);        // the probe goes out
  net.deliver(0, 1);      // rank 0's proposal
  r.step();
  REQUIRE(r.bound.count(1));
  CHECK(r.bound[1] == (Key{10, 0}));
  CHECK_EQ(r.bound_from[1], 0);
  CHECK(!r.bound.count(2));  // rank 2 has not answered yet
  net.settle();
  r.step();
  REQUIRE(r.bound.count(2));
  CHECK(r.bound[2] == (Key{20, 0}));
  CHECK_EQ(r.bound_from[2], 2);
  net.settle();
  CHECK(net.side(1, 0).launched == std::vector<intptr_t>{name({10, 0})});
  CHECK(net.side(0, 1).launched == net.side(1, 0).launched);
  CHECK(net.side(1, 2).launched == std::vector<intptr_t>{name({20, 0})});
  CHECK(net.side(2, 1).launched == net.side(1, 2).launched);
}

// Rank 2 answers the probe first: the recv binds to it; rank 0's proposal, arriving later, is
// taken by the next recv. The probe did not claim rank 2's send: it is launched only once the
// receiver proposes the recv bound to it.
TEST(any_source_two_senders_race_follower_first) {
  Net net;
  Receiver r(net, 1);
  r.post(1, kAny, true);
  r.step();
  net.flush(1, 2);
  net.send(2, 1, 20, 0);
  net.deliver(1, 2);  // the probe: rank 2's send is ready, it answers
  CHECK(net.side(2, 1).launched.empty());
  net.deliver(2, 1);
  net.send(0, 1, 10, 0);
  net.flush(0, 1);  // on the wire, not delivered
  r.step();
  REQUIRE(r.bound.count(1));
  CHECK(r.bound[1] == (Key{20, 0}));
  r.post(2, kAny, true);
  net.settle();
  r.step();
  REQUIRE(r.bound.count(2));
  CHECK(r.bound[2] == (Key{10, 0}));
  net.settle();
  CHECK(net.side(2, 1).launched == std::vector<intptr_t>{name({20, 0})});
  CHECK(net.side(0, 1).launched == std::vector<intptr_t>{name({10, 0})});
  CHECK(net.side(1, 0).launched == net.side(0, 1).launched);
  CHECK(net.side(1, 2).launched == net.side(2, 1).launched);
}

// Random interleavings of two senders, each sending twice, against four recvs from any source
// posted over time: every recv gets exactly one message, each message goes to exactly one recv,
// each sender's messages are taken in their order, and both sides of each pair launch the same
// items in the same order.
TEST(any_source_random_interleavings_match_every_message_once) {
  for (unsigned seed = 1; seed <= 300; ++seed) {
    std::mt19937 rng(seed);
    Net net;
    Receiver r(net, 1);
    int posted = 0, sent0 = 0, sent2 = 0;
    for (int steps = 0; steps < 400; ++steps) {
      switch (rng() % 7) {
        case 0:
          if (posted < 4) r.post(++posted, kAny, true);
          break;
        case 1:
          if (sent0 < 2) {
            net.send(0, 1, 10, (uint64_t)sent0++);
            net.flush(0, 1);
          }
          break;
        case 2:
          if (sent2 < 2) net.send(2, 1, 20, (uint64_t)sent2++);
          break;
        case 3:
          r.step();
          break;
        case 4:
          net.flush(1, 2);
          net.deliver(1, 2, 1);
          break;
        case 5:
          net.deliver(2, 1, 1);
          break;
        default:
          net.deliver(0, 1, 1);
          net.deliver(1, 0, 1);
      }
    }
    while (posted < 4) r.post(++posted, kAny, true);
    while (sent0 < 2) net.send(0, 1, 10, (uint64_t)sent0++);
    while (sent2 < 2) net.send(2, 1, 20, (uint64_t)sent2++);
    for (int i = 0; i < 8; ++i) {
      net.settle();
      r.step();
    }
    net.settle();
    CHECK_MSG(r.bound.size() == 4, "seed " + std::to_string(seed));
    std::set<std::pair<uint64_t, uint64_t>> keys;
    for (auto& [t, k] : r.bound) keys.insert({k.id, k.seq});
    CHECK_MSG(keys.size() == 4, "seed " + std::to_string(seed));
    // Each sender's messages in order: a recv posted earlier took the lower number.
    std::map<uint64_t, uint64_t> last;
    for (auto& [t, k] : r.bound) {
      if (last.count(k.id)) CHECK_MSG(k.seq > last[k.id], "seed " + std::to_string(seed));
      last[k.id] = k.seq;
    }
    CHECK_MSG(net.side(1, 0).launched == net.side(0, 1).launched, "seed " + std::to_string(seed));
    CHECK_MSG(net.side(1, 2).launched == net.side(2, 1).launched, "seed " + std::to_string(seed));
    CHECK_EQ(net.side(1, 0).launched.size() + net.side(1, 2).launched.size(), size_t(4));
    CHECK(!net.side(1, 0).m.holding() && !net.side(1, 2).m.holding());
  }
}

// A recv from any source, then one from rank 0: rank 0's first message goes to the first recv
// (posted first), its second to the named one, even though the named recv could take the first.
TEST(any_source_then_named_source_keeps_posting_order) {
  Net net;
  Receiver r(net, 1);
  r.post(1, kAny, true);
  r.post(2, {kFrom0}, false);
  r.step();
  CHECK(r.bound.empty());  // the named recv waits behind the unbound one
  net.send(0, 1, 10, 0);
  net.send(0, 1, 10, 1);
  net.flush(0, 1);
  net.deliver(0, 1);
  r.step();
  CHECK(r.bound[1] == (Key{10, 0}));
  CHECK(r.bound[2] == (Key{10, 1}));
  net.settle();
  CHECK(net.side(1, 0).launched == (std::vector<intptr_t>{name({10, 0}), name({10, 1})}));
  CHECK(net.side(0, 1).launched == net.side(1, 0).launched);
  // Rank 2's message first: the recv from any source takes it, the named one rank 0's first.
  Net net2;
  Receiver r2(net2, 1);
  r2.post(1, kAny, true);
  r2.post(2, {kFrom0}, false);
  r2.step();
  net2.flush(1, 2);
  net2.send(2, 1, 20, 0);
  net2.settle();
  r2.step();
  CHECK(r2.bound[1] == (Key{20, 0}));
  CHECK(r2.bound[2] == (Key{10, 0}));
  net2.send(0, 1, 10, 0);
  net2.flush(0, 1);
  net2.settle();
  CHECK(net2.side(1, 0).launched == std::vector<intptr_t>{name({10, 0})});
  CHECK(net2.side(1, 2).launched == std::vector<intptr_t>{name({20, 0})});
}

// A candidate's channel fails while the recv is unbound: it fails naming that member, unless a
// live member's message was offered first (then it binds to that one). The recvs behind it go on.
TEST(any_source_sender_dies_while_unbound) {
  Net net;
  Receiver r(net, 1);
  r.post(1, kAny, true);
  r.post(2, kAny, true);
  r.post(3, {kFrom0}, false);
  r.step();
  net.send(0, 1, 10, 0);
  net.flush(0, 1);
  net.deliver(0, 1);
  r.dead.insert(2);  // rank 2 is gone, rank 0's message is offered: it is taken
  r.step();
  CHECK(r.bound[1] == (Key{10, 0}));
  REQUIRE(r.failures.count(2));  // nothing else offered: it fails, naming rank 2
  CHECK_EQ(r.failures[2], 2);
  CHECK(r.bound[3] == (Key{10, 1}));  // the named recv behind it takes rank 0's next message
  CHECK(!r.bound.count(2));
  // Timed out (the engine's deadline): taken out without a number.
  r.post(4, kAny, true);
  r.dead.clear();
  r.step();
  CHECK(r.ports.remove(r, r.next_seq, (void*)4));
  CHECK(!r.ports.remove(r, r.next_seq, (void*)4));
  CHECK(r.ports.empty());
}

// Zero-byte messages are agreed like any other; a recv from any source whose size differs from
// the message it is bound to fails on both sides (as a named one would).
TEST(any_source_zero_bytes_and_size_mismatch) {
  Net net;
  Receiver r(net, 1);
  r.post(1, kAny, true, 0);
  r.post(2, kAny, true, 8);
  r.step();
  net.send(2, 1, 20, 0, 0);
  net.settle();
  r.step();
  CHECK(r.bound[1] == (Key{20, 0}));
  net.settle();
  CHECK(net.side(1, 2).launched == std::vector<intptr_t>{name({20, 0})});
  CHECK(net.side(2, 1).launched == net.side(1, 2).launched);
  net.send(0, 1, 10, 0, 12);
  net.settle();
  r.step();
  CHECK(r.bound[2] == (Key{10, 0}));
  net.settle();
  CHECK(net.failed_with(1, 0, name({10, 0}), Why::kMismatch));
  CHECK(net.failed_with(0, 1, name({10, 0}), Why::kMismatch));
}

// The follower resets while a probe is on the wire: the stale probe is dropped, the leader asks
// again in the new epoch, and the answer binds the recv. A message the reset cancelled counts as
// offered: the recv bound to it fails (as a named one would), and the next message is agreed.
TEST(any_source_probe_survives_resets_and_cancelled_messages_fail_it) {
  Net net;
  Receiver r(net, 1);
  r.post(1, kAny, true);
  r.step();
  net.flush(1, 2);  // probe in epoch 0, on the wire
  {
    PairAgreement::Out o;
    net.side(2, 1).m.reset({}, o);  // rank 2 resets (another op of the pair timed out)
    net.take(net.side(2, 1), o);
  }
  net.deliver(1, 2);  // stale probe: dropped
  net.deliver(2, 1);  // the reset: rank 1 asks again
  net.settle();
  net.send(2, 1, 20, 0);
  net.settle();
  r.step();
  CHECK(r.bound[1] == (Key{20, 0}));
  net.settle();
  CHECK(net.side(1, 2).launched == std::vector<intptr_t>{name({20, 0})});
  // Rank 0 resets with its message 10:0 launched there: cancelled on both sides.
  r.post(2, kAny, true);
  r.step();
  {
    PairAgreement::Out o;
    net.side(0, 1).m.reset({Key{10, 0}}, o);
    net.take(net.side(0, 1), o);
  }
  net.settle();
  r.step();
  CHECK(r.bound[2] == (Key{10, 0}));
  CHECK(net.failed_with(1, 0, name({10, 0}), Why::kCancelled));
  r.post(3, kAny, true);
  r.step();
  net.send(0, 1, 10, 1);
  net.settle();
  r.step();
  CHECK(r.bound[3] == (Key{10, 1}));
  net.settle();
  CHECK(net.side(1, 0).launched == std::vector<intptr_t>{name({10, 1})});
  CHECK(net.side(0, 1).launched == net.side(1, 0).launched);
}

// A plan's start (or a batch) posts named recvs while a recv from any source waits unbound on
// the same (group, tag): they queue behind it, as a single named recv does; on another tag, or
// once the port is empty again, a named recv takes its number at post.
TEST(any_source_later_plan_recvs_queue_behind_an_unbound_one) {
  const DeviceOp::Sender from0tag1{0, 0, 11};  // channel (group, 0 -> 1, tag 1)
  Net net;
  Receiver r(net, 1);
  r.post(1, {kFrom0}, false);  // nothing waits: 10:0 at post
  CHECK(r.bound[1] == (Key{10, 0}));
  r.post(2, kAny, true);
  r.post(3, {kFrom0}, false);     // the plan's recvs, started now
  r.post(4, {kFrom2}, false);
  r.post(5, {from0tag1}, false, 8, 1);  // another tag: its own port, numbered at once
  CHECK(r.bound[5] == (Key{11, 0}));
  r.step();
  CHECK(!r.bound.count(2) && !r.bound.count(3) && !r.bound.count(4));
  // Only rank 0 sends (three messages): the recv from any source takes its second, posted
  // before the plan's, which takes the third; rank 2's first stays for recv 4.
  for (uint64_t n = 0; n < 3; ++n) net.send(0, 1, 10, n);
  net.settle();
  r.step();
  CHECK(r.bound[2] == (Key{10, 1}));
  CHECK_EQ(r.bound_from[2], 0);
  CHECK(r.bound[3] == (Key{10, 2}));
  CHECK(r.bound[4] == (Key{20, 0}));
  CHECK(r.ports.empty());
  r.post(6, {kFrom2}, false);  // the port is empty again: numbered at post
  CHECK(r.bound[6] == (Key{20, 1}));
  net.send(2, 1, 20, 0);
  net.send(2, 1, 20, 1);
  net.send(0, 1, 11, 0);
  net.settle();
  CHECK(net.side(1, 0).launched ==
        (std::vector<intptr_t>{name({10, 0}), name({10, 1}), name({10, 2}), name({11, 0})}));
  CHECK(net.side(0, 1).launched == net.side(1, 0).launched);
  CHECK(net.side(1, 2).launched == (std::vector<intptr_t>{name({20, 0}), name({20, 1})}));
  CHECK(net.side(2, 1).launched == net.side(1, 2).launched);
}
