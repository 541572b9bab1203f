// The in-place all_reduce (algorithms/direct.cpp) over a fake group whose members share one
// address space: results, and whom a member stalled mid-run says it waits for.
#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "algorithms/direct.h"
#include "exchange_cluster.h"
#include "transport/transport.h"
#include "unit.h"

namespace {

using exchange_test::FakeComm;
using exchange_test::Net;
using fastcomm::Comm;
using fastcomm::Message;
using fastcomm::Op;
using fastcomm::SharedSpan;

// FakeComm whose members all share memory: a span is its address.
class SharedComm final : public Comm {
 public:
  SharedComm(Net& net, int rank) : inner_(net, rank) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  size_t max_payload() const override { return inner_.max_payload(); }
  bool send(int to, uint64_t offset, uint32_t tag, const void* data, uint32_t len) override {
    return inner_.send(to, offset, tag, data, len);
  }
  void flush() override { inner_.flush(); }
  const Message* peek(int from) override { return inner_.peek(from); }
  void pop(int from) override { inner_.pop(from); }
  void check_abort(int from) override { inner_.check_abort(from); }
  size_t bulk_min(int to) override { return inner_.bulk_min(to); }
  std::shared_ptr<fastcomm::Bulk> send_bulk(int to, uint32_t tag, at::Tensor b) override {
    return inner_.send_bulk(to, tag, std::move(b));
  }
  std::shared_ptr<fastcomm::Bulk> recv_bulk(int from, const Message& m, at::Tensor b, fastcomm::Bulk* o) override {
    return inner_.recv_bulk(from, m, std::move(b), o);
  }
  bool shares_memory(int) override { return true; }
  bool export_span(const void* p, size_t n, SharedSpan* out) override {
    out->buffer = reinterpret_cast<uint64_t>(p);
    out->bytes = n;
    out->size = n;
    return true;
  }
  const uint8_t* import_span(int, const SharedSpan& s) override { return reinterpret_cast<const uint8_t*>(s.buffer); }

 private:
  FakeComm inner_;
};

// Stands in for the ring fallback, which a group sharing memory never takes.
class NoFallback final : public Op {
 public:
  NoFallback() : Op({}) {}
  bool step(Comm&) override {
    CHECK_MSG(false, "the fallback ran");
    return false;
  }
  bool done() const override { return false; }
  void append_outputs(std::vector<at::Tensor>&) const override {}
};

struct Group {
  Net net;
  std::vector<std::unique_ptr<SharedComm>> comm;
  std::vector<at::Tensor> t;
  std::vector<std::unique_ptr<Op>> op;
  explicit Group(int size, int64_t n) : net(size, 4096, 0) {
    for (int r = 0; r < size; ++r) {
      comm.push_back(std::make_unique<SharedComm>(net, r));
      t.push_back(at::full({n}, (double)(r + 1), at::kFloat));
      fastcomm::OpDesc d;
      d.numel = (uint64_t)n;
      op.push_back(fastcomm::make_direct_all_reduce(d, t[r], r, size, std::make_unique<NoFallback>()));
    }
  }
  bool step(int r) { return op[r]->step(*comm[r]); }
  std::vector<int> awaiting(int r) const {
    std::vector<int> a;
    op[r]->awaiting(a);
    return a;
  }
};

}  // namespace

TEST(direct_all_reduce_sums_in_place) {
  for (int64_t n : {1L, 7L, 300001L}) {
    Group g(3, n);
    for (int round = 0; round < 100; ++round)
      for (int r = 0; r < 3; ++r) g.step(r);
    for (int r = 0; r < 3; ++r) {
      REQUIRE(g.op[r]->done());
      CHECK(at::equal(g.t[r], at::full({n}, 6.0, at::kFloat)));
    }
  }
}

// Members 0 and 1 run; member 2 agrees to run, then stops before its slice is folded. Both
// others wait for its chunks, and say so (their timeout names it).
TEST(direct_all_reduce_stalled_mid_run_names_the_member) {
  Group g(3, 3 * 200000);  // several 256 KB chunks per slice
  g.step(0);
  g.step(1);
  g.step(2);  // its "where" heard from all: it posts "mapped" and waits there
  for (int round = 0; round < 10; ++round) {
    g.step(0);
    g.step(1);
  }
  for (int r = 0; r < 2; ++r) {
    CHECK(!g.op[r]->done());
    CHECK(g.awaiting(r) == std::vector<int>{2});
  }
  for (int round = 0; round < 100; ++round)
    for (int r = 0; r < 3; ++r) g.step(r);
  for (int r = 0; r < 3; ++r) {
    REQUIRE(g.op[r]->done());
    CHECK(at::equal(g.t[r], at::full({3 * 200000}, 6.0, at::kFloat)));
    CHECK(g.awaiting(r).empty());
  }
}
