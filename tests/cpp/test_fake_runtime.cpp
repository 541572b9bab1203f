// Unit tests of the CPU fake of the device runtime (device/fake_runtime.cpp): streams, events,
// folds, copies with their flag, the asynchronous caller stream and capture modes
// (test_fake_nccl.cpp has its communicators). Waits are bounded polls with a deadline; "stays
// pending" checks hold for a short while only.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

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

}  // namespace
