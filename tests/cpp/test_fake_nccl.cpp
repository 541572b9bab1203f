// Unit tests of the CPU fake's NCCL side (device/fake_nccl.cpp, fake_comm*.cpp): several Runtime
// instances in this one process play the ranks of a communicator; sends and receives matched
// in issue order, groups, collectives against a reference fold, NCCL's dtype set, the
// ncclInProgress window, aborts, peers gone, and nothing left behind.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <dirent.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "device/runtime.h"
#include "fake_runtime.h"
#include "unit.h"

namespace {

using namespace fastcomm::device;
using namespace fastcomm::device::testing;


TEST(fake_runtime_send_completes_when_recv_runs) {
  Ranks k(2);
  REQUIRE(k.all_ready());
  std::vector<float> out(1000), in(1000, -1.0f);
  for (size_t i = 0; i < out.size(); ++i) out[i] = 0.5f * static_cast<float>(i);
  k.rt[0]->send(out.data(), out.size() * sizeof(float), 1, k.comm[0], k.stream[0]);
  Event sent = mark(*k.rt[0], k.stream[0]);
  CHECK(stays([&] { return !ready(*k.rt[0], sent); }));  // no receive yet: the send is stuck
  k.rt[1]->recv(in.data(), in.size() * sizeof(float), 0, k.comm[1], k.stream[1]);
  Event got = mark(*k.rt[1], k.stream[1]);
  CHECK(done(*k.rt[1], got));
  CHECK(done(*k.rt[0], sent));
  CHECK(in == out);
  CHECK_EQ(k.state(0), State::kReady);
  CHECK_EQ(k.state(1), State::kReady);
}

// Sends and receives with a peer match in issue order, whatever order their streams run them in.
TEST(fake_runtime_matching_in_issue_order) {
  Ranks k(2);
  Runtime& r1 = *k.rt[1];
  Gate gate(r1);
  Stream a = k.stream[1], b = r1.new_stream();
  std::vector<uint8_t> m0(4, 1), m1(8, 2), m2(12, 3);
  std::vector<uint8_t> g0(4), g1(8), g2(12);
  for (auto* m : {&m0, &m1, &m2}) k.rt[0]->send(m->data(), m->size(), 1, k.comm[0], k.stream[0]);
  Event sent = mark(*k.rt[0], k.stream[0]);
  r1.wait(a, gate.e);
  r1.recv(g0.data(), g0.size(), 0, k.comm[1], a);  // #0, behind the gate
  r1.recv(g1.data(), g1.size(), 0, k.comm[1], b);  // #1, on a free stream
  r1.recv(g2.data(), g2.size(), 0, k.comm[1], a);  // #2
  Event eb = mark(r1, b), ea = mark(r1, a);
  // #1 must not take send #0; send #1 is not even out (the sender's stream waits for #0's ack).
  CHECK(stays([&] { return !ready(r1, eb) && !ready(r1, ea) && !ready(*k.rt[0], sent); }));
  gate.open();
  CHECK(done(r1, ea));
  CHECK(done(r1, eb));
  CHECK(done(*k.rt[0], sent));
  CHECK(g0 == m0);
  CHECK(g1 == m1);
  CHECK(g2 == m2);
  CHECK_EQ(k.state(1), State::kReady);
}

TEST(fake_runtime_grouped_exchange_large) {
  Ranks k(2);
  const size_t n = (size_t(8) << 20) / sizeof(int32_t);  // 8 MB each way
  std::vector<std::vector<int32_t>> out(2, std::vector<int32_t>(n)), in(2, std::vector<int32_t>(n, -1));
  for (size_t i = 0; i < n; ++i) {
    out[0][i] = static_cast<int32_t>(i);
    out[1][i] = static_cast<int32_t>(3 * i + 1);
  }
  std::vector<Event> ev;
  for (int r = 0; r < 2; ++r) {
    Runtime& rt = *k.rt[r];
    rt.group_start();
    rt.send(out[r].data(), n * 4, 1 - r, k.comm[r], k.stream[r]);
    rt.recv(in[r].data(), n * 4, 1 - r, k.comm[r], k.stream[r]);
    rt.group_end();
    ev.push_back(mark(rt, k.stream[r]));
  }
  CHECK(done(*k.rt[0], ev[0]));
  CHECK(done(*k.rt[1], ev[1]));
  CHECK(in[0] == out[1]);
  CHECK(in[1] == out[0]);
}

// Only the outermost group_end launches; outside a group, a send then a receive on each side
// deadlock (each send waits for a receive queued behind it), as with NCCL, until aborted.
TEST(fake_runtime_group_nesting_and_ungrouped_deadlock) {
  Ranks k(2);
  REQUIRE(k.all_ready());
  int a = 11, b = 22, got0 = 0, got1 = 0;
  Runtime &r0 = *k.rt[0], &r1 = *k.rt[1];
  r0.group_start();
  r0.group_start();
  r0.send(&a, sizeof a, 1, k.comm[0], k.stream[0]);
  r0.group_end();
  Event e0 = mark(r0, k.stream[0]);  // not behind the send: it is not launched yet
  r1.recv(&got1, sizeof got1, 0, k.comm[1], k.stream[1]);
  Event e1 = mark(r1, k.stream[1]);
  CHECK(done(r0, e0));
  CHECK(stays([&] { return !ready(r1, e1); }));
  r0.group_end();
  e0 = mark(r0, k.stream[0]);
  CHECK(done(r1, e1));
  CHECK(done(r0, e0));
  CHECK_EQ(got1, 11);

  // Ungrouped: each stream sends first.
  r0.send(&a, sizeof a, 1, k.comm[0], k.stream[0]);
  r0.recv(&got0, sizeof got0, 1, k.comm[0], k.stream[0]);
  got1 = 0;
  r1.send(&b, sizeof b, 0, k.comm[1], k.stream[1]);
  r1.recv(&got1, sizeof got1, 0, k.comm[1], k.stream[1]);
  e0 = mark(r0, k.stream[0]);
  e1 = mark(r1, k.stream[1]);
  CHECK(stays([&] { return !ready(r0, e0) && !ready(r1, e1); }));
  r0.comm_abort(k.comm[0]);
  r1.comm_abort(k.comm[1]);
  CHECK(done(r0, e0));
  CHECK(done(r1, e1));
  // Aborted work moves no data, but a receive whose message had arrived may still land it.
  CHECK(got0 == 0 || got0 == 22);
  CHECK(got1 == 0 || got1 == 11);
  CHECK(k.fails_with(0, "aborted"));
  CHECK(k.fails_with(1, "aborted"));
}

// The reference fold: contributions in rank order, each step rounded to T, AVG divided at the end.
template <typename T>
std::vector<T> reference(const std::vector<std::vector<T>>& c, RedOp op) {
  std::vector<T> r = c[0];
  for (size_t k = 1; k < c.size(); ++k)
    for (size_t i = 0; i < r.size(); ++i) {
      const float x = static_cast<float>(r[i]), y = static_cast<float>(c[k][i]);
      if constexpr (std::is_same_v<T, double>) {
        const double dx = r[i], dy = c[k][i];
        r[i] = op == RedOp::PRODUCT ? dx * dy : dx + dy;
      } else {
        r[i] = static_cast<T>(op == RedOp::PRODUCT ? x * y : x + y);
      }
    }
  if (op == RedOp::AVG)
    for (auto& v : r) {
      if constexpr (std::is_same_v<T, double>) v = v / 3.0;
      else v = static_cast<T>(static_cast<float>(v) / 3.0f);
    }
  return r;
}

template <typename T>
void check_all_reduce(Ranks& k, c10::ScalarType dtype, RedOp op, bool in_place) {
  const int n = 3;
  const size_t count = 1037;
  std::vector<std::vector<T>> in(n, std::vector<T>(count)), out(n, std::vector<T>(count));
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < count; ++i)
      in[r][i] = static_cast<T>((op == RedOp::PRODUCT ? 1.0f : 1000.0f) + 0.1f * static_cast<float>((i * 7 + r * 13) % 17) -
                                0.037f * static_cast<float>(r) * static_cast<float>(i % 5));
  const std::vector<T> want = reference(in, op);
  std::vector<Event> ev;
  for (int r = 0; r < n; ++r) {
    void* dst = in_place ? static_cast<void*>(in[r].data()) : static_cast<void*>(out[r].data());
    k.rt[r]->all_reduce(in[r].data(), dst, static_cast<int64_t>(count), dtype, op, k.comm[r], k.stream[r]);
    ev.push_back(mark(*k.rt[r], k.stream[r]));
  }
  for (int r = 0; r < n; ++r) {
    REQUIRE(done(*k.rt[r], ev[r]));
    const std::vector<T>& got = in_place ? in[r] : out[r];
    CHECK_MSG(std::memcmp(got.data(), want.data(), count * sizeof(T)) == 0,
              "rank " << r << " dtype " << c10::toString(dtype) << " op " << static_cast<int>(op)
                      << (in_place ? " in place" : "") << ": not bit-identical to the rank-order fold");
  }
}

TEST(fake_runtime_all_reduce_three_ranks) {
  Ranks k(3);
  check_all_reduce<float>(k, c10::ScalarType::Float, RedOp::SUM, false);
  check_all_reduce<float>(k, c10::ScalarType::Float, RedOp::AVG, false);
  check_all_reduce<float>(k, c10::ScalarType::Float, RedOp::PRODUCT, false);
  check_all_reduce<float>(k, c10::ScalarType::Float, RedOp::SUM, true);
  check_all_reduce<double>(k, c10::ScalarType::Double, RedOp::AVG, true);
  check_all_reduce<c10::Half>(k, c10::ScalarType::Half, RedOp::SUM, false);
  check_all_reduce<c10::BFloat16>(k, c10::ScalarType::BFloat16, RedOp::AVG, false);
  for (int r = 0; r < 3; ++r) CHECK_EQ(k.state(r), State::kReady);
}

TEST(fake_runtime_broadcast_gather_scatter) {
  const int n = 3;
  Ranks k(n);
  // broadcast from rank 1
  std::vector<std::vector<int64_t>> buf(n, std::vector<int64_t>(100));
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < 100; ++i) buf[r][i] = r == 1 ? i * i : -1;
  std::vector<Event> ev(n);
  for (int r = 0; r < n; ++r) {
    k.rt[r]->broadcast(buf[r].data(), 100 * sizeof(int64_t), 1, k.comm[r], k.stream[r]);
    ev[r] = mark(*k.rt[r], k.stream[r]);
  }
  for (int r = 0; r < n; ++r) {
    REQUIRE(done(*k.rt[r], ev[r]));
    CHECK(buf[r] == buf[1]);
  }
  // all_gather, rank 2 in place (its input is its own block of the output)
  const size_t m = 50;
  std::vector<std::vector<int32_t>> gin(n, std::vector<int32_t>(m)), gout(n, std::vector<int32_t>(n * m, -1));
  std::vector<int32_t> gwant(n * m);
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < m; ++i) gin[r][i] = gwant[r * m + i] = static_cast<int32_t>(r * 1000 + i);
  std::copy(gin[2].begin(), gin[2].end(), gout[2].begin() + 2 * m);
  for (int r = 0; r < n; ++r) {
    const void* src = r == 2 ? static_cast<const void*>(gout[2].data() + 2 * m) : gin[r].data();
    k.rt[r]->all_gather(src, gout[r].data(), m * sizeof(int32_t), k.comm[r], k.stream[r]);
    ev[r] = mark(*k.rt[r], k.stream[r]);
  }
  for (int r = 0; r < n; ++r) {
    REQUIRE(done(*k.rt[r], ev[r]));
    CHECK(gout[r] == gwant);
  }
  // reduce_scatter (SUM of int32: exact), rank 0 in place
  std::vector<std::vector<int32_t>> sin(n, std::vector<int32_t>(n * m)), sout(n, std::vector<int32_t>(m, -1));
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < n * m; ++i) sin[r][i] = static_cast<int32_t>((r + 1) * i);
  for (int r = 0; r < n; ++r) {
    void* dst = r == 0 ? static_cast<void*>(sin[0].data()) : static_cast<void*>(sout[r].data());
    k.rt[r]->reduce_scatter(sin[r].data(), dst, static_cast<int64_t>(m), c10::ScalarType::Int, RedOp::SUM, k.comm[r],
                            k.stream[r]);
    ev[r] = mark(*k.rt[r], k.stream[r]);
  }
  for (int r = 0; r < n; ++r) {
    REQUIRE(done(*k.rt[r], ev[r]));
    const int32_t* got = r == 0 ? sin[0].data() : sout[r].data();
    for (size_t i = 0; i < m; ++i) {
      const size_t j = r * m + i;
      if (!CHECK_EQ(got[i], static_cast<int32_t>(6 * j))) break;  // (1 + 2 + 3) * j
    }
  }
}

// A launch keeps its communicator busy for a while (ncclInProgress): comm_state says kPending
// and a call on it is refused, until the window passes.
TEST(fake_runtime_launch_in_progress_refuses_calls) {
  Ranks k(2);
  REQUIRE(k.all_ready());
  Runtime& r0 = *k.rt[0];
  r0.debug("enqueue_us", 200000);
  int v = 1, w = 0;
  r0.send(&v, sizeof v, 1, k.comm[0], k.stream[0]);
  CHECK(k.state(0) == State::kPending);
  CHECK_THROWS(r0.send(&v, sizeof v, 1, k.comm[0], k.stream[0]), c10::DistBackendError);
  k.rt[1]->recv(&w, sizeof w, 0, k.comm[1], k.stream[1]);
  CHECK(eventually([&] { return k.state(0) == State::kReady; }));
  r0.debug("enqueue_us", 0);
  Event e = mark(*k.rt[1], k.stream[1]);
  CHECK(done(*k.rt[1], e));
  CHECK_EQ(w, 1);
}

// NCCL's dtype set: its reductions refuse int16; the fold takes it.
TEST(fake_runtime_nccl_dtypes) {
  Ranks k(1);
  REQUIRE(k.all_ready());
  std::vector<int16_t> a = {1, 2};
  CHECK_THROWS(k.rt[0]->all_reduce(a.data(), a.data(), 2, c10::ScalarType::Short, RedOp::SUM, k.comm[0], k.stream[0]),
               c10::DistBackendError);
  std::vector<int16_t> scr = {3, 4}, dst = {0, 0};
  FoldJob j{dst.data(), a.data(), scr.data(), 2, 2, 0, c10::ScalarType::Short, RedOp::SUM};
  k.rt[0]->fold(&j, 1, k.stream[0]);
  Event e = mark(*k.rt[0], k.stream[0]);
  k.rt[0]->synchronize(e);
  CHECK_EQ(dst[1], 6);
}


// A receive whose data has arrived still lands after comm_abort (abort races the transfer),
// and a stream that writes into freed scratch is counted.
TEST(fake_runtime_abort_races_arrived_data) {
  Ranks k(2);
  REQUIRE(k.all_ready());
  Runtime& r1 = *k.rt[1];
  Gate gate(r1);
  Stream other = r1.new_stream();
  const int64_t before = r1.debug("late_writes", 0);
  int a = 42, b = 43, got_b = 0;
  k.rt[0]->group_start();  // both sends out at once
  k.rt[0]->send(&a, sizeof a, 1, k.comm[0], k.stream[0]);
  k.rt[0]->send(&b, sizeof b, 1, k.comm[0], k.stream[0]);
  k.rt[0]->group_end();
  r1.wait(k.stream[1], gate.e);  // the first receive cannot run yet
  {
    at::Tensor t = r1.scratch(1, at::empty({1}, at::kInt), r1.current_stream());
    r1.recv(t.data_ptr(), sizeof a, 0, k.comm[1], k.stream[1]);
  }  // freed once the caller's stream passes (it has nothing queued) while the receive waits
  r1.recv(&got_b, sizeof b, 0, k.comm[1], other);
  Event second = mark(r1, other);
  CHECK(done(r1, second));  // the second message is in, so the first (sent before it) is too
  Event freed = mark(r1, r1.current_stream());
  r1.synchronize(freed);
  r1.comm_abort(k.comm[1]);
  gate.open();
  Event after = mark(r1, k.stream[1]);
  CHECK(done(r1, after));
  CHECK_EQ(got_b, 43);
  CHECK_EQ(r1.debug("late_writes", 0), before + 1);
}

TEST(fake_runtime_pending_until_every_rank_inits) {
  Ranks k(3, 2);  // rank 2 has not called comm_init
  CHECK(stays([&] { return k.state(0) == State::kPending && k.state(1) == State::kPending; }));
  int v = 5, got = 0;
  k.rt[0]->send(&v, sizeof v, 2, k.comm[0], k.stream[0]);  // first contact with a rank not there
  Event e = mark(*k.rt[0], k.stream[0]);
  CHECK(stays([&] { return !ready(*k.rt[0], e); }, milliseconds(30)));
  k.join(2);
  CHECK(k.all_ready());
  k.rt[2]->recv(&got, sizeof got, 0, k.comm[2], k.stream[2]);
  CHECK(done(*k.rt[0], e));
  Event e2 = mark(*k.rt[2], k.stream[2]);
  CHECK(done(*k.rt[2], e2));
  CHECK_EQ(got, 5);
}

TEST(fake_runtime_abort_releases_stream_and_peer_sees_it) {
  Ranks k(2);
  REQUIRE(k.all_ready());
  int v = 1, x = 3, y = 0;
  k.rt[0]->send(&v, sizeof v, 1, k.comm[0], k.stream[0]);  // never received
  k.rt[0]->copy(&y, &x, sizeof x, k.stream[0]);
  Event e = mark(*k.rt[0], k.stream[0]);
  CHECK(stays([&] { return !ready(*k.rt[0], e) && y == 0; }));
  k.rt[0]->comm_abort(k.comm[0]);
  CHECK(done(*k.rt[0], e));
  CHECK_EQ(y, 3);  // the stream drained behind it
  CHECK(k.fails_with(0, "aborted"));
  // The peer's connection is gone: rank 1 fails once an operation needs rank 0 (the message
  // that had arrived is still taken).
  int first = 0, second = 0;
  k.rt[1]->recv(&first, sizeof first, 0, k.comm[1], k.stream[1]);
  CHECK(stays([&] { return k.state(1) == State::kReady; }, milliseconds(30)) || k.state(1) != State::kFailed);
  k.rt[1]->recv(&second, sizeof second, 0, k.comm[1], k.stream[1]);
  CHECK(k.fails_with(1, "peer rank 0"));
  // Work issued on the aborted communicator completes at once, moving nothing.
  int got = -1;
  k.rt[0]->recv(&got, sizeof got, 1, k.comm[0], k.stream[0]);
  e = mark(*k.rt[0], k.stream[0]);
  CHECK(done(*k.rt[0], e));
  CHECK_EQ(got, -1);
  k.rt[0]->comm_destroy(k.comm[0]);
  k.rt[1]->comm_abort(k.comm[1]);
  k.rt[1]->comm_destroy(k.comm[1]);
}

TEST(fake_runtime_peer_destroyed) {
  Ranks k(3);
  REQUIRE(k.all_ready());
  k.rt[1]->comm_destroy(k.comm[1]);
  // Nothing needs rank 1 yet: the others stay usable with each other.
  int v = 4, got = 0;
  k.rt[0]->group_start();
  k.rt[0]->send(&v, sizeof v, 2, k.comm[0], k.stream[0]);
  k.rt[0]->group_end();
  k.rt[2]->recv(&got, sizeof got, 0, k.comm[2], k.stream[2]);
  Event e = mark(*k.rt[2], k.stream[2]);
  CHECK(done(*k.rt[2], e));
  CHECK_EQ(got, 4);
  CHECK(k.state(0) != State::kFailed && k.state(2) != State::kFailed);
  // An operation that needs it fails the communicator, naming it.
  k.rt[0]->recv(&got, sizeof got, 1, k.comm[0], k.stream[0]);
  int w = 5;
  k.rt[2]->send(&w, sizeof w, 1, k.comm[2], k.stream[2]);
  CHECK(k.fails_with(0, "peer rank 1"));
  CHECK(k.fails_with(2, "peer rank 1"));
}

TEST(fake_runtime_size_mismatch) {
  Ranks k(2);
  std::vector<uint8_t> out(16, 9), in(8, 0);
  k.rt[0]->send(out.data(), out.size(), 1, k.comm[0], k.stream[0]);
  k.rt[1]->recv(in.data(), in.size(), 0, k.comm[1], k.stream[1]);
  Event e0 = mark(*k.rt[0], k.stream[0]), e1 = mark(*k.rt[1], k.stream[1]);
  CHECK(k.fails_with(1, "size mismatch"));
  CHECK(k.fails_with(0, "size mismatch"));  // told by rank 1
  // The failed work stays stuck, as NCCL's does, until the communicators are aborted.
  CHECK(stays([&] { return !ready(*k.rt[0], e0) && !ready(*k.rt[1], e1); }, milliseconds(30)));
  k.rt[0]->comm_abort(k.comm[0]);
  k.rt[1]->comm_abort(k.comm[1]);
  CHECK(done(*k.rt[0], e0));
  CHECK(done(*k.rt[1], e1));
  CHECK(in == std::vector<uint8_t>(8, 0));
}

// A Runtime destroyed with a live communicator and work stuck on it aborts it (the peer sees
// the connection lost) and joins everything.
TEST(fake_runtime_destroyed_with_live_comm) {
  Ranks k(2);
  REQUIRE(k.all_ready());
  int v = 1;
  k.rt[0]->send(&v, sizeof v, 1, k.comm[0], k.stream[0]);
  at::Tensor t = k.rt[0]->scratch(10, at::empty({1}, at::kFloat), k.stream[0]);
  k.rt[0].reset();
  t = at::Tensor();  // its stream is gone: freed at once
  int got = 0;
  k.rt[1]->recv(&got, sizeof got, 0, k.comm[1], k.stream[1]);  // takes the message that arrived
  k.rt[1]->recv(&got, sizeof got, 0, k.comm[1], k.stream[1]);  // needs the peer: fails
  CHECK(k.fails_with(1, "peer rank 0"));
}

// A communicator of one rank is ready at once; a rank may send to itself within a group.
TEST(fake_runtime_single_rank_and_self) {
  Ranks k(1);
  REQUIRE(k.all_ready());
  Runtime& rt = *k.rt[0];
  std::vector<float> a = {1.0f, 2.0f, 3.0f}, b(3, 0.0f);
  rt.group_start();
  rt.send(a.data(), 12, 0, k.comm[0], k.stream[0]);
  rt.recv(b.data(), 12, 0, k.comm[0], k.stream[0]);
  rt.group_end();
  rt.all_reduce(a.data(), a.data(), 3, c10::ScalarType::Float, RedOp::AVG, k.comm[0], k.stream[0]);
  Event e = mark(rt, k.stream[0]);
  CHECK(done(rt, e));
  CHECK(b == a);
  CHECK_EQ(a[2], 3.0f);
}

// Entries of a /proc/self directory (open fds, threads).
int count_entries(const char* dir) {
  int n = 0;
  if (DIR* d = opendir(dir)) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}

// Streams, communicators and runtimes leave no thread and no socket behind.
TEST(fake_runtime_leaves_nothing) {
  const int fds = count_entries("/proc/self/fd"), threads = count_entries("/proc/self/task");
  {
    Ranks k(3);
    REQUIRE(k.all_ready());
    std::vector<std::vector<float>> v(3, std::vector<float>(64, 1.0f));
    std::vector<Event> ev;
    for (int r = 0; r < 3; ++r) {
      k.rt[r]->all_reduce(v[r].data(), v[r].data(), 64, c10::ScalarType::Float, RedOp::SUM, k.comm[r], k.stream[r]);
      ev.push_back(mark(*k.rt[r], k.stream[r]));
    }
    for (int r = 0; r < 3; ++r) CHECK(done(*k.rt[r], ev[r]));
    CHECK_EQ(v[2][63], 3.0f);
    CHECK(count_entries("/proc/self/task") > threads);
    // Rank 0 tidies up by the book; ranks 1 and 2 leave it to their Runtime's destructor.
    k.rt[0]->comm_destroy(k.comm[0]);
    k.rt[0]->destroy_stream(k.stream[0]);
  }
  CHECK_EQ(count_entries("/proc/self/fd"), fds);
  CHECK_EQ(count_entries("/proc/self/task"), threads);
}

}  // namespace
