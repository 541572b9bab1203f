// Unit tests of the pair agreement (device/agreement.h) over scripted interleavings: two
// machines, a leader and a follower, and the ordered frames between them, delivered one at a
// time in the order each test chooses.
#include <deque>
#include <string>
#include <vector>

#include "device/agreement.h"
#include "unit.h"

using namespace fastcomm::device;

namespace {

using Why = PairAgreement::Why;

// An item's token is its name (a small integer); what each side launched, failed and decided.
struct Side {
  explicit Side(bool leader) : m(leader) {}
  PairAgreement m;
  std::deque<Frame> out;  // frames sent, not yet delivered
  std::vector<intptr_t> launched, answered, awaiting;
  std::vector<std::pair<intptr_t, Why>> failed;
  std::vector<std::pair<intptr_t, bool>> decided;
  bool new_epoch = false;

  void take(PairAgreement::Out& o) {
    for (void* t : o.launch) launched.push_back((intptr_t)t);
    for (void* t : o.answered) answered.push_back((intptr_t)t);
    for (void* t : o.awaiting) awaiting.push_back((intptr_t)t);
    for (auto& f : o.failed) failed.push_back({(intptr_t)f.token, f.why});
    for (auto& d : o.decided) decided.push_back({(intptr_t)d.token, d.go});
    new_epoch = new_epoch || o.new_epoch;
    for (auto& f : o.frames) out.push_back(f);
    o.clear();
  }
  void ready(uint64_t group, uint64_t seq, intptr_t name, uint64_t bytes = 8, bool agree_only = false) {
    PairAgreement::Out o;
    Sig s;
    s.kind = 1;
    s.bytes = bytes;
    m.ready(Item{Key{group, seq}, s, agree_only, (void*)name}, o);
    take(o);
  }
  void flush() {
    PairAgreement::Out o;
    m.flush(o);
    take(o);
  }
  void reset(const std::vector<Key>& launched_keys = {}) {
    PairAgreement::Out o;
    m.reset(launched_keys, o);
    take(o);
  }
  bool failed_with(intptr_t name, Why why) const {
    for (auto& [n, w] : failed)
      if (n == name && w == why) return true;
    return false;
  }
};

struct Pair {
  Side L{true}, F{false};
  // Delivers the next `n` frames `from` sent (all of them for n < 0).
  void deliver(Side& from, Side& to, int n = -1) {
    while (n != 0 && !from.out.empty()) {
      Frame f = from.out.front();
      from.out.pop_front();
      PairAgreement::Out o;
      to.m.receive(f, o);
      to.take(o);
      --n;
    }
  }
  void settle() {
    while (!L.out.empty() || !F.out.empty()) {
      deliver(L, F);
      deliver(F, L);
    }
  }
};

}  // namespace

TEST(agreement_both_sides_launch_in_one_order) {
  Pair p;
  p.L.ready(1, 0, 10);
  p.L.ready(2, 0, 20);
  p.L.flush();
  p.F.ready(2, 0, 20);  // ready here in the other order
  p.F.ready(1, 0, 10);
  p.settle();
  CHECK(p.L.launched == p.F.launched);
  CHECK_EQ(p.L.launched.size(), size_t(2));
  // A proposal with no item yet does not hold back the next one.
  p.L.ready(3, 0, 30);
  p.L.ready(4, 0, 40);
  p.L.flush();
  p.F.ready(4, 0, 40);
  p.settle();
  CHECK_EQ(p.F.launched.back(), intptr_t(40));
  CHECK(p.L.m.waiting());  // item 30 still waits for the follower
  p.F.ready(3, 0, 30);
  p.settle();
  CHECK(p.L.launched == p.F.launched);
  CHECK(!p.L.m.waiting() && !p.F.m.waiting());
}

TEST(agreement_mismatch_fails_both) {
  Pair p;
  p.L.ready(1, 0, 10, 8);
  p.L.flush();
  p.F.ready(1, 0, 10, 12);
  p.settle();
  CHECK(p.L.failed_with(10, Why::kMismatch));
  CHECK(p.F.failed_with(10, Why::kMismatch));
  CHECK(p.L.launched.empty() && p.F.launched.empty());
}

// The leader resets while its proposal is on the wire: the follower commits (and launches) it in
// the old epoch, then takes the reset, which fails what was launched there; the late commit is
// stale at the leader. The pair then agrees in the new epoch.
TEST(agreement_leader_reset_races_a_commit) {
  Pair p;
  p.L.ready(1, 0, 10);
  p.L.flush();
  p.F.ready(1, 0, 10);
  p.L.reset();
  CHECK(p.L.failed_with(10, Why::kReset));
  CHECK_EQ(p.L.m.epoch(), uint32_t(1));
  p.deliver(p.L, p.F, 1);  // the proposal (epoch 0)
  CHECK(p.F.launched == std::vector<intptr_t>{10});
  p.deliver(p.L, p.F, 1);  // the reset
  CHECK(p.F.new_epoch);    // the engine fails what it launched in epoch 0 (item 10)
  CHECK_EQ(p.F.m.epoch(), uint32_t(1));
  p.settle();
  CHECK(p.L.launched.empty());
  p.L.ready(1, 1, 11);
  p.L.flush();
  p.F.ready(1, 1, 11);
  p.settle();
  CHECK(p.L.launched == std::vector<intptr_t>{11});
  CHECK(p.F.launched.back() == 11);
}

// Items one side cancelled fail on the other side too, whether it had them then or issues them
// later; items of other groups go on.
TEST(agreement_floors_cancel_on_both_sides) {
  Pair p;
  p.L.ready(2, 0, 20);  // proposed, the follower has not issued it yet
  p.L.flush();
  p.F.ready(3, 0, 30);  // issued on the follower only
  p.deliver(p.L, p.F);  // the proposal of 20
  p.F.reset();          // the follower times out: 30 fails, 20 (proposed to it) is cancelled
  CHECK(p.F.failed_with(30, Why::kReset));
  p.settle();
  CHECK(p.L.failed_with(20, Why::kReset));  // the leader takes the reset
  p.L.ready(3, 0, 30);                      // issued later on the leader: under the floor
  CHECK(p.L.failed_with(30, Why::kCancelled));
  p.F.ready(2, 0, 20);  // issued later on the follower: under the floor
  CHECK(p.F.failed_with(20, Why::kCancelled));
  p.L.ready(4, 0, 40);  // another group
  p.L.flush();
  p.F.ready(4, 0, 40);
  p.settle();
  CHECK(p.L.launched == std::vector<intptr_t>{40});
  CHECK(p.F.launched == std::vector<intptr_t>{40});
}

// The ack carries the peer's floors: an item only the acking side had is cancelled at the side
// that reset first, even where it is issued only after the reset.
TEST(agreement_ack_cancels_what_only_the_peer_had) {
  Pair p;
  p.F.ready(5, 0, 50);  // the follower waits for a proposal the leader has not issued
  p.L.ready(6, 0, 60);
  p.L.reset({Key{7, 2}});  // and a launched item of group 7, seq 2
  CHECK(p.L.failed_with(60, Why::kReset));
  p.deliver(p.L, p.F);
  CHECK(p.F.failed_with(50, Why::kReset));
  p.F.ready(7, 1, 71);  // under the leader's floor for group 7
  CHECK(p.F.failed_with(71, Why::kCancelled));
  p.deliver(p.F, p.L);  // the ack
  p.L.ready(5, 0, 50);
  CHECK(p.L.failed_with(50, Why::kCancelled));
  p.L.ready(7, 3, 73);  // past the floor: runs
  p.L.flush();
  p.F.ready(7, 3, 73);
  p.settle();
  CHECK(p.L.launched == std::vector<intptr_t>{73});
}

// Both sides reset at once: each takes the other's floors; a proposal under the follower's floor
// that crossed its reset is answered kCancel.
TEST(agreement_simultaneous_resets) {
  Pair p;
  p.F.ready(8, 0, 80);
  p.L.reset();
  p.F.reset();  // 80 fails, floor 8:0
  CHECK(p.F.failed_with(80, Why::kReset));
  p.L.ready(8, 0, 80);  // the leader issues it before the follower's reset arrives
  p.L.flush();
  p.settle();
  CHECK(p.L.failed_with(80, Why::kCancelled));
  CHECK_EQ(p.L.m.epoch(), p.F.m.epoch());
  p.L.ready(9, 0, 90);
  p.L.flush();
  p.F.ready(9, 0, 90);
  p.settle();
  CHECK(p.L.launched == std::vector<intptr_t>{90});
  CHECK(p.F.launched == std::vector<intptr_t>{90});
}

// Agreement items (a group communicator's op): the leader hears the commit, the follower the
// group leader's decision; a reset cancels an item waiting for its decision.
TEST(agreement_items_of_group_communicators) {
  Pair p;
  p.L.ready(10, 0, 100, 8, true);
  p.L.flush();
  p.F.ready(10, 0, 100, 8, true);
  p.settle();
  CHECK(p.L.answered == std::vector<intptr_t>{100});
  CHECK(p.F.awaiting == std::vector<intptr_t>{100});  // the follower's commit: it awaits the decision
  CHECK(p.F.launched.empty());
  CHECK(p.F.m.waiting());
  PairAgreement::Out o;
  p.F.m.receive(Frame{kGo, 0, {Entry{Key{10, 0}, Sig{}}}}, o);
  p.F.take(o);
  CHECK(p.F.decided.size() == 1 && p.F.decided[0].second);
  p.L.ready(10, 1, 101, 8, true);
  p.L.flush();
  p.F.ready(10, 1, 101, 8, true);
  p.settle();
  p.F.reset();
  CHECK(p.F.failed_with(101, Why::kReset));
  p.F.m.receive(Frame{kRefuse, 1, {Entry{Key{10, 1}, Sig{}}}}, o);  // too late: dropped
  p.F.take(o);
  CHECK_EQ(p.F.decided.size(), size_t(1));
}
