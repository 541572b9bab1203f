// Unit tests of the CPU fake of the device runtime (device/fake_runtime.cpp): several Runtime
// instances in this one process play the ranks of a communicator. Sends and receives run on
// stream threads, so one test thread drives every rank; only host-stream work blocks it. Waits
// are bounded polls with a deadline; "stays pending" checks hold for a short while only.
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
using RedOp = c10d::ReduceOp::RedOpType;
using std::chrono::milliseconds;

// pred() all along `span` (a negative check: what must not happen has not, for a while).
bool stays(const std::function<bool()>& pred, milliseconds span = milliseconds(60)) {
  const auto end = std::chrono::steady_clock::now() + span;
  while (std::chrono::steady_clock::now() < end) {
    if (!pred()) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return pred();
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

bool done(Runtime& rt, Event e) {
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

TEST(fake_runtime_basics) {
  auto rt = fake();
  CHECK_EQ(std::string(rt->name()), std::string("fake"));
  CHECK_EQ(rt->device(), 0);
  Stream host = rt->current_stream();
  Stream s = rt->new_stream();
  CHECK(!rt->capturing(host));
  CHECK(!rt->capturing(s));
  const UniqueId a = rt->new_id(), b = rt->new_id();
  CHECK(std::memcmp(a.bytes.data(), b.bytes.data(), 16) != 0);

  Event e = rt->new_event();
  CHECK(ready(*rt, e));  // never recorded: complete
  rt->synchronize(e);
  rt->record(e, host);  // the caller's stream has nothing pending
  CHECK(done(*rt, e));

  // The caller's stream runs its work in order, after the host returned; so does any stream.
  int x = 1, y = 0;
  rt->copy(&y, &x, sizeof x, host);
  rt->record(e, host);
  rt->synchronize(e);
  CHECK_EQ(y, 1);
  std::vector<int> chain(200, 0);
  chain[0] = 42;
  for (size_t i = 1; i < chain.size(); ++i) rt->copy(&chain[i], &chain[i - 1], sizeof(int), s);
  rt->record(e, s);
  rt->synchronize(e);
  CHECK(ready(*rt, e));
  for (int v : chain) CHECK_EQ(v, 42);

  at::Tensor like = at::zeros({4}, at::kFloat);
  at::Tensor t = rt->scratch(1000, like, s);
  CHECK_EQ(t.numel(), 1000);
  CHECK(t.scalar_type() == at::kFloat);
  CHECK(t.device().is_cpu());
  rt->keep(like, s);
  rt->destroy_event(e);
  rt->destroy_stream(s);
}

TEST(fake_runtime_call_errors) {
  auto rt = fake();
  const UniqueId id = rt->new_id();
  CHECK_THROWS(rt->comm_init(id, 0, 0), c10::DistBackendError);
  CHECK_THROWS(rt->comm_init(id, 2, 2), c10::DistBackendError);
  CHECK_THROWS(rt->comm_init(UniqueId{}, 2, 0), c10::DistBackendError);
  Comm c = rt->comm_init(id, 2, 0);
  try {
    rt->comm_init(id, 2, 0);  // the same rank twice on one host
    CHECK_MSG(false, "a second comm_init of one rank did not throw");
  } catch (const c10::DistBackendError& e) {
    CHECK_MSG(contains(e.what(), "comm_init"), e.what());
  }
  Stream s = rt->new_stream();
  int v = 0;
  try {
    rt->send(&v, sizeof v, 2, c, s);
    CHECK_MSG(false, "a send to rank 2 of 2 did not throw");
  } catch (const c10::DistBackendError& e) {
    CHECK_MSG(contains(e.what(), "send"), e.what());
  }
  CHECK_THROWS(rt->recv(&v, sizeof v, -1, c, s), c10::DistBackendError);
  CHECK_THROWS(rt->group_end(), c10::DistBackendError);
  CHECK_THROWS(rt->record(rt->new_event(), reinterpret_cast<Stream>(&v)), c10::DistBackendError);
  CHECK_THROWS(rt->comm_state(reinterpret_cast<Comm>(&v), nullptr), c10::DistBackendError);
  CHECK_THROWS(rt->destroy_stream(rt->current_stream()), c10::DistBackendError);
  FoldJob j{&v, &v, nullptr, 1, 1, 0, c10::ScalarType::Int, RedOp::AVG};
  CHECK_THROWS(rt->fold(&j, 1, s), c10::DistBackendError);
  CHECK_THROWS(rt->all_reduce(&v, &v, 1, c10::ScalarType::Int, RedOp::PREMUL_SUM, c, s), c10::DistBackendError);
  CHECK_EQ(rt->comm_state(c, nullptr), State::kPending);  // rank 1 never comes
  rt->comm_destroy(c);
}

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

// One fold of three contributions (own at position 1) of dtype T, on the host stream.
template <typename T>
std::vector<float> fold3(Runtime& rt, Stream s, c10::ScalarType dtype, RedOp op, float a, float b, float c,
                         bool into_own = false) {
  std::vector<T> own = {static_cast<T>(b), static_cast<T>(b)};
  std::vector<T> scratch = {static_cast<T>(a), static_cast<T>(a), static_cast<T>(c), static_cast<T>(c)};
  std::vector<T> dst(2, static_cast<T>(-7.0f));
  FoldJob j{into_own ? own.data() : dst.data(), own.data(), scratch.data(), 2, 3, 1, dtype, op};
  rt.fold(&j, 1, s);
  Event e = mark(rt, s);
  rt.synchronize(e);
  rt.destroy_event(e);
  const std::vector<T>& got = into_own ? own : dst;
  return {static_cast<float>(got[0]), static_cast<float>(got[1])};
}

template <typename T>
void check_min_max(Runtime& rt, Stream s, c10::ScalarType dtype) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::string name = c10::toString(dtype);
  for (RedOp op : {RedOp::MIN, RedOp::MAX}) {
    for (int at = 0; at < 3; ++at) {  // the NaN from each position, own included
      const float a = at == 0 ? nan : 1.0f, b = at == 1 ? nan : -2.0f, c = at == 2 ? nan : 3.0f;
      for (bool into_own : {false, true}) {
        const auto got = fold3<T>(rt, s, dtype, op, a, b, c, into_own);
        CHECK_MSG(std::isnan(got[0]) && std::isnan(got[1]),
                  name << " op " << static_cast<int>(op) << " NaN at " << at << ": got " << got[0]);
      }
    }
    const auto got = fold3<T>(rt, s, dtype, op, 1.0f, -2.0f, 3.0f);
    CHECK_EQ(got[0], op == RedOp::MIN ? -2.0f : 3.0f);
  }
}

TEST(fake_runtime_fold) {
  auto rt = fake();
  Stream s = rt->new_stream();
  for (Stream on : {rt->current_stream(), s}) {
    check_min_max<float>(*rt, on, c10::ScalarType::Float);
    check_min_max<double>(*rt, on, c10::ScalarType::Double);
    check_min_max<c10::Half>(*rt, on, c10::ScalarType::Half);
    check_min_max<c10::BFloat16>(*rt, on, c10::ScalarType::BFloat16);
  }
  // Order: ((c0 + own) + c2), and AVG divides by n; dst may be own.
  CHECK_EQ(fold3<float>(*rt, s, c10::ScalarType::Float, RedOp::SUM, 1e8f, 1.0f, -1e8f)[0], 0.0f);
  CHECK_EQ(fold3<float>(*rt, s, c10::ScalarType::Float, RedOp::SUM, 1e8f, -1e8f, 1.0f, true)[0], 1.0f);
  CHECK_EQ(fold3<float>(*rt, s, c10::ScalarType::Float, RedOp::AVG, 3.0f, 6.0f, 9.0f, true)[0], 6.0f);
  CHECK_EQ(fold3<double>(*rt, s, c10::ScalarType::Double, RedOp::PRODUCT, 2.0f, 3.0f, 4.0f, true)[0], 24.0f);
  // Several jobs in one call, integers.
  std::vector<int32_t> own1 = {5}, own2 = {7}, scr = {1, 2}, dst2 = {0};
  FoldJob jobs[2] = {{own1.data(), own1.data(), scr.data(), 1, 3, 2, c10::ScalarType::Int, RedOp::SUM},
                     {dst2.data(), own2.data(), scr.data(), 1, 2, 0, c10::ScalarType::Int, RedOp::MAX}};
  rt->fold(jobs, 2, s);
  Event e = mark(*rt, s);
  rt->synchronize(e);
  CHECK_EQ(own1[0], 8);
  CHECK_EQ(dst2[0], 7);
}

// wait(s, e) orders s after the record that was latest at the call; a later record does not
// change what that wait waits for. Scratch memory outlives the tensor until its stream's work ran.
TEST(fake_runtime_event_wait_orders_streams) {
  auto rt = fake();
  Gate gate(*rt);
  Stream s = rt->new_stream();
  const std::vector<float> src(4096, 2.5f);
  std::vector<float> dst(4096, 0.0f);
  rt->wait(s, gate.e);
  {
    at::Tensor t = rt->scratch(4096, at::empty({1}, at::kFloat), s);
    rt->copy(t.data_ptr(), src.data(), src.size() * sizeof(float), s);
    rt->copy(dst.data(), t.data_ptr(), src.size() * sizeof(float), s);
  }  // dropped before the stream ran the copies
  Event after = mark(*rt, s);
  rt->record(gate.e, rt->current_stream());  // gate.e is ready once the caller's stream passes...
  CHECK(done(*rt, gate.e));
  CHECK(stays([&] { return !ready(*rt, after) && dst[0] == 0.0f; }));  // ...but s still waits
  gate.open();
  CHECK(done(*rt, after));
  CHECK(dst == src);

  // A wait on the caller's stream holds the work behind it, not the host.
  Gate gate2(*rt);
  rt->wait(rt->current_stream(), gate2.e);
  int v = 0, one = 1;
  rt->copy(&v, &one, sizeof one, rt->current_stream());
  Event behind = mark(*rt, rt->current_stream());
  CHECK(stays([&] { return !ready(*rt, behind) && v == 0; }));
  gate2.open();
  CHECK(done(*rt, behind));
  CHECK_EQ(v, 1);
}

// copy_flag and fold_flag: the copy (or fold) and then the flag store, as ONE entry on the stream
// (copy then flag_write takes two): neither the data nor the flag moves before the work ahead of
// them has run, and a waiter on the flag sees the data.
TEST(fake_runtime_copy_flag_and_fold_flag) {
  auto rt = fake();
  Gate gate(*rt);
  Stream s = rt->new_stream();
  rt->wait(s, gate.e);
  const std::vector<float> src(1000, 1.5f);
  std::vector<float> dst(1000, 0.0f), own(1000, 2.0f), sum(1000, 0.0f);
  uint32_t filled = 0, consumed = 0;
  const int64_t before = rt->debug("work_entries", 0);
  rt->copy_flag(dst.data(), src.data(), src.size() * sizeof(float), &filled, 3, s);
  FoldJob j{sum.data(), own.data(), dst.data(), 1000, 2, 1, c10::ScalarType::Float, RedOp::SUM};
  rt->fold_flag(j, &consumed, 3, s);
  CHECK_EQ(rt->debug("work_entries", 0) - before, 2);
  Event after = mark(*rt, s);
  CHECK(stays([&] { return __atomic_load_n(&filled, __ATOMIC_ACQUIRE) == 0 && dst[0] == 0.0f; }));
  gate.open();
  CHECK(done(*rt, after));
  CHECK_EQ(filled, 3u);
  CHECK_EQ(consumed, 3u);
  CHECK(dst == src);
  CHECK_EQ(sum[0], 3.5f);  // the peer's 1.5 (folded first: group rank 0) + own 2.0
  CHECK_EQ(sum[999], 3.5f);
  // The defaults' two entries each, for comparison.
  const int64_t mid = rt->debug("work_entries", 0);
  rt->copy(dst.data(), src.data(), src.size() * sizeof(float), s);
  rt->flag_write(&filled, 4, s);
  CHECK_EQ(rt->debug("work_entries", 0) - mid, 2);
  CHECK(done(*rt, mark(*rt, s)));
  CHECK_EQ(filled, 4u);
}

// The caller's stream runs ahead of nothing: a send there returns at once, and an event behind
// it completes only once the peer's receive has run (an event recorded behind queued work is
// not complete).
TEST(fake_runtime_caller_stream_is_asynchronous) {
  Ranks k(2);
  int v = 99, got = 0;
  Runtime& r0 = *k.rt[0];
  r0.send(&v, sizeof v, 1, k.comm[0], r0.current_stream());
  Event sent = mark(r0, r0.current_stream());
  CHECK(stays([&] { return !ready(r0, sent); }));
  k.rt[1]->recv(&got, sizeof got, 0, k.comm[1], k.stream[1]);
  CHECK(done(r0, sent));
  Event in = mark(*k.rt[1], k.stream[1]);
  CHECK(done(*k.rt[1], in));
  CHECK_EQ(got, 99);
  // "spin": a long kernel on the caller's stream.
  r0.debug("spin", 100);
  Event after = mark(r0, r0.current_stream());
  CHECK(!ready(r0, after));
  CHECK(done(r0, after));
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

// A global-mode capture of the caller's stream: a query from a thread not in the relaxed mode
// invalidates it and fails; one from a relaxed thread does not.
TEST(fake_runtime_capture_modes) {
  auto rt = fake();
  Event e = mark(*rt, rt->current_stream());
  rt->synchronize(e);
  rt->debug("begin_capture", 0);
  CHECK(rt->capturing(rt->current_stream()));
  bool relaxed_ok = false;
  std::thread t([&] {
    rt->relax_capture_mode();
    relaxed_ok = rt->query(e) == State::kReady;
  });
  t.join();
  CHECK(relaxed_ok);
  CHECK_EQ(rt->debug("end_capture", 0), 1);
  rt->debug("begin_capture", 0);
  std::thread u([&] { CHECK_THROWS(rt->query(e), c10::DistBackendError); });
  u.join();
  CHECK_EQ(rt->debug("end_capture", 0), 0);  // invalidated
  rt->debug("begin_capture", 1);              // thread-local mode: others may query
  std::thread v([&] { CHECK(rt->query(e) == State::kReady); });
  v.join();
  CHECK_EQ(rt->debug("end_capture", 0), 1);
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
