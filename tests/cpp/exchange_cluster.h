#pragma once
// The fake group of the Exchange unit tests (test_exchange_copy.cpp, test_exchange_fold.cpp):
// several "ranks" in one process, each with its own Exchange and a fake Comm whose sends go
// straight into the receiver's queue. The ranks are stepped round-robin until every exchange is
// done, so the interleavings are deterministic (or seeded) and a bug shows as a wrong value or a
// stall, never as a hang. Also the data helpers both files use (random values, references).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <vector>

#include "algorithms/exchange.h"
#include "algorithms/reduce.h"
#include "unit.h"

namespace exchange_test {


using fastcomm::Comm;
using fastcomm::Exchange;
using fastcomm::ExchangePlan;
using fastcomm::Header;
using fastcomm::Message;
using fastcomm::Span;
using RedOp = c10d::ReduceOp::RedOpType;

// ---------------------------------------------------------------------------------------
// The fake group.

struct Queued {
  Header hdr;
  std::vector<uint8_t> data;
};

// The wire between the ranks: q[to][from] holds what `from` sent to `to`, oldest first;
// log[from][to] every header ever sent that way.
struct Net {
  int size;
  size_t max_payload;
  size_t capacity;  // most messages queued from one rank to another (0: no bound)
  std::vector<std::vector<std::deque<Queued>>> q;
  std::vector<std::vector<std::vector<Header>>> log;
  size_t refused = 0;  // sends answered false for want of room

  Net(int n, size_t mp, size_t cap)
      : size(n),
        max_payload(mp),
        capacity(cap),
        q(n, std::vector<std::deque<Queued>>(n)),
        log(n, std::vector<std::vector<Header>>(n)) {}

  size_t queued() const {
    size_t k = 0;
    for (const auto& row : q)
      for (const auto& d : row) k += d.size();
    return k;
  }
};

class FakeComm final : public Comm {
 public:
  FakeComm(Net& net, int rank) : net_(net), rank_(rank), cur_(net.size) {}

  int rank() const override { return rank_; }
  int size() const override { return net_.size; }
  size_t max_payload() const override { return net_.max_payload; }

  bool send(int to, uint64_t offset, uint32_t tag, const void* data, uint32_t len) override {
    CHECK(to >= 0 && to < net_.size && to != rank_);
    CHECK_MSG(len <= net_.max_payload, "piece of " << len << " bytes exceeds max_payload " << net_.max_payload);
    auto& dq = net_.q[to][rank_];
    if (net_.capacity && dq.size() >= net_.capacity) {
      ++net_.refused;
      return false;
    }
    Queued m;
    m.hdr.offset = offset;
    m.hdr.tag = tag;
    m.hdr.len = len;
    // Copied at send time, as a transport does: the sender may overwrite its span afterwards.
    const auto* p = static_cast<const uint8_t*>(data);
    if (len) m.data.assign(p, p + len);
    net_.log[rank_][to].push_back(m.hdr);
    dq.push_back(std::move(m));
    return true;
  }
  void flush() override { ++flushes; }
  const Message* peek(int from) override {
    auto& dq = net_.q[rank_][from];
    if (dq.empty()) return nullptr;
    cur_[from].hdr = dq.front().hdr;
    cur_[from].data = dq.front().data.data();
    return &cur_[from];
  }
  void pop(int from) override {
    auto& dq = net_.q[rank_][from];
    if (CHECK_MSG(!dq.empty(), "rank " << rank_ << " pops an empty queue from " << from)) dq.pop_front();
  }
  void check_abort(int) override {}
  size_t bulk_min(int) override { return SIZE_MAX; }
  std::shared_ptr<fastcomm::Bulk> send_bulk(int, uint32_t, at::Tensor) override {
    CHECK_MSG(false, "send_bulk called although bulk_min is SIZE_MAX");
    return nullptr;
  }
  std::shared_ptr<fastcomm::Bulk> recv_bulk(int, const Message&, at::Tensor, fastcomm::Bulk*) override {
    CHECK_MSG(false, "recv_bulk called although no offer was ever sent");
    return nullptr;
  }

  int flushes = 0;

 private:
  Net& net_;
  int rank_;
  std::vector<Message> cur_;  // by sender: what peek returned (valid until pop)
};

struct Cluster {
  Net net;
  std::vector<std::unique_ptr<FakeComm>> comm;
  std::vector<Exchange> ex;

  Cluster(int size, size_t max_payload, size_t capacity = 0) : net(size, max_payload, capacity), ex(size) {
    for (int r = 0; r < size; ++r) comm.push_back(std::make_unique<FakeComm>(net, r));
  }
  int size() const { return net.size; }

  void start(int r, ExchangePlan p, size_t es, std::vector<at::Tensor> owners) {
    ex[r].start(std::move(p), r, size(), es, *comm[r], std::move(owners));
  }

  // Steps the ranks round-robin (in a fresh random order each round when seed != 0) until
  // every exchange is done. `next(r)`, asked when rank r's exchange is done, may start its
  // next phase (true) or say it has none (false). Records a failure and returns false if the
  // ranks stop moving or take implausibly many rounds.
  bool run(uint64_t seed = 0, const std::function<bool(int)>& next = {}) {
    const int n = size();
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::vector<char> finished(n, 0);
    std::mt19937_64 rng(seed);
    int idle_rounds = 0;
    constexpr int kMaxRounds = 1000000;
    for (int round = 0; round < kMaxRounds; ++round) {
      if (std::all_of(finished.begin(), finished.end(), [](char f) { return f != 0; })) return true;
      if (seed) std::shuffle(order.begin(), order.end(), rng);
      bool progress = false;
      for (int r : order) {
        if (finished[r]) continue;
        if (ex[r].done()) {
          if (!(next && next(r))) finished[r] = 1;
          progress = true;
          continue;
        }
        progress |= ex[r].step(*comm[r]);
        progress |= ex[r].done();
      }
      // Nothing changes between steps but what steps do: rounds without progress are a stall.
      idle_rounds = progress ? 0 : idle_rounds + 1;
      if (idle_rounds >= 3) {
        std::ostringstream os;
        os << "exchange stalled after " << round << " rounds; done:";
        for (int r = 0; r < n; ++r) os << " " << ex[r].done();
        os << "; messages queued: " << net.queued();
        unit::fail(__FILE__, __LINE__, os.str());
        return false;
      }
    }
    unit::fail(__FILE__, __LINE__, "exchange not done after the round limit");
    return false;
  }
};

inline ExchangePlan blank_plan(int size) {
  ExchangePlan p;
  p.send.resize(size);
  p.recv.resize(size);
  return p;
}

// The pieces a span of `len` bytes must travel in: offsets piece apart, the last one short,
// one empty message for an empty span.
inline void check_stream(const std::vector<Header>& msgs, size_t len, size_t piece, uint32_t tag, int from, int to) {
  const size_t want = len == 0 ? 1 : (len + piece - 1) / piece;
  if (!CHECK_MSG(msgs.size() == want, "from " << from << " to " << to << ": " << msgs.size()
                                              << " messages, expected " << want))
    return;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const size_t off = i * piece;
    CHECK_EQ(msgs[i].offset, off);
    CHECK_EQ(msgs[i].len, std::min(piece, len - off));
    CHECK_EQ(msgs[i].tag, tag);
  }
}

inline size_t piece_of(size_t max_payload, size_t es) { return std::max(es, max_payload / es * es); }

// A span of `len` bytes in a byte tensor followed by guard bytes that nothing may write.
struct Buf {
  static constexpr size_t kGuard = 64;
  static constexpr uint8_t kFill = 0xA5;
  at::Tensor t;
  size_t len;

  explicit Buf(size_t n) : t(at::empty({(int64_t)(n + kGuard)}, at::TensorOptions().dtype(at::kByte))), len(n) {
    std::memset(ptr(), kFill, n + kGuard);
  }
  uint8_t* ptr() const { return t.data_ptr<uint8_t>(); }
  Span span() const { return Span::of(ptr(), len); }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(ptr());
  }
  template <typename T>
  void set(const std::vector<T>& v) {
    TORCH_INTERNAL_ASSERT(v.size() * sizeof(T) == len);
    if (len) std::memcpy(ptr(), v.data(), len);
  }
  bool guard_intact() const {
    for (size_t i = 0; i < kGuard; ++i)
      if (ptr()[len + i] != kFill) return false;
    return true;
  }
};

inline std::vector<uint8_t> random_bytes(size_t n, std::mt19937_64& g) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = (uint8_t)g();
  return v;
}

// Magnitudes spread over many binades, so float sums depend on their order (that is what
// makes the group-rank order checkable).
template <typename T = float>
std::vector<T> random_floats(size_t n, std::mt19937_64& g) {
  std::uniform_int_distribution<int> e(-8, 16);
  std::uniform_real_distribution<T> m(1, 2);
  std::vector<T> v(n);
  for (auto& x : v) x = std::ldexp(m(g), e(g)) * ((g() & 1) ? T(-1) : T(1));
  return v;
}

inline std::vector<int64_t> random_i64(size_t n, std::mt19937_64& g) {
  std::vector<int64_t> v(n);
  for (auto& x : v) x = (int64_t)g();  // full range: sums wrap, as the kernels (-fwrapv) do
  return v;
}

// The fold every rank must produce: contributions of `ranks` combined in that order.
template <typename T>
std::vector<T> fold_reference(const std::vector<std::vector<T>>& x, const std::vector<int>& ranks, RedOp op,
                              int divisor) {
  std::vector<T> acc = x[ranks[0]];
  for (size_t k = 1; k < ranks.size(); ++k) {
    const auto& y = x[ranks[k]];
    for (size_t i = 0; i < acc.size(); ++i) {
      if constexpr (std::is_integral_v<T>) {
        TORCH_INTERNAL_ASSERT(op == RedOp::SUM);
        acc[i] = (T)((uint64_t)acc[i] + (uint64_t)y[i]);
      } else if (op == RedOp::MAX) {
        acc[i] = std::max(acc[i], y[i]);
      } else {
        acc[i] = acc[i] + y[i];
      }
    }
  }
  if constexpr (std::is_floating_point_v<T>) {
    if (op == RedOp::AVG)
      for (auto& a : acc) a = a / (T)divisor;
  }
  return acc;
}

// Element-by-element bit equality, reporting the first difference.
template <typename T>
bool check_values(const T* got, const std::vector<T>& want, const std::string& what) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      CHECK_MSG(false, what << ": element " << i << " is " << unit::show(got[i]) << ", expected "
                            << unit::show(want[i]));
      return false;
    }
  }
  return true;
}

template <typename T>
constexpr c10::ScalarType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return c10::ScalarType::Float;
  else if constexpr (std::is_same_v<T, double>) return c10::ScalarType::Double;
  else return c10::ScalarType::Long;
}

template <typename T>
std::vector<T> random_values(size_t n, std::mt19937_64& g) {
  if constexpr (std::is_integral_v<T>) return random_i64(n, g);
  else return random_floats<T>(n, g);
}

}  // namespace exchange_test
