// Unit tests of Exchange (algorithms/exchange.h): several "ranks" in one process, each with
// its own Exchange and a fake Comm whose sends go straight into the receiver's queue. The
// ranks are stepped round-robin until every exchange is done, so the interleavings are
// deterministic (or seeded) and a bug shows as a wrong value or a stall, never as a hang.
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

namespace {

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

ExchangePlan blank_plan(int size) {
  ExchangePlan p;
  p.send.resize(size);
  p.recv.resize(size);
  return p;
}

// The pieces a span of `len` bytes must travel in: offsets piece apart, the last one short,
// one empty message for an empty span.
void check_stream(const std::vector<Header>& msgs, size_t len, size_t piece, uint32_t tag, int from, int to) {
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

size_t piece_of(size_t max_payload, size_t es) { return std::max(es, max_payload / es * es); }

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

std::vector<uint8_t> random_bytes(size_t n, std::mt19937_64& g) {
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

std::vector<int64_t> random_i64(size_t n, std::mt19937_64& g) {
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

// ---------------------------------------------------------------------------------------
// Copy mode: every rank sends its span to every other (all_gather).

struct CopyCase {
  int size = 2;
  std::vector<size_t> len;  // by sender; a multiple of es
  size_t es = 1;
  size_t max_payload = 64;
  size_t capacity = 0;
  uint64_t seed = 0;
  uint32_t tag = 7;
};

// Returns the cluster so callers can look at what travelled.
std::unique_ptr<Cluster> run_copy(const CopyCase& c) {
  const int n = c.size;
  std::mt19937_64 g(1000 + c.seed);
  auto cl = std::make_unique<Cluster>(n, c.max_payload, c.capacity);
  std::vector<std::vector<uint8_t>> data(n);
  std::vector<Buf> in;
  std::vector<std::vector<Buf>> out(n);
  for (int r = 0; r < n; ++r) {
    data[r] = random_bytes(c.len[r], g);
    in.emplace_back(c.len[r]);
    in[r].set(data[r]);
  }
  for (int r = 0; r < n; ++r) {
    ExchangePlan p = blank_plan(n);
    p.tag = c.tag;
    std::vector<at::Tensor> owners{in[r].t};
    for (int q = 0; q < n; ++q) {
      out[r].emplace_back(q == r ? 0 : c.len[q]);
      if (q == r) continue;
      p.send[q] = in[r].span();
      p.recv[q] = out[r][q].span();
      owners.push_back(out[r][q].t);
    }
    cl->start(r, std::move(p), c.es, owners);
  }
  if (!cl->run(c.seed)) return cl;
  CHECK_EQ(cl->net.queued(), 0u);
  const size_t piece = piece_of(c.max_payload, c.es);
  for (int r = 0; r < n; ++r) {
    check_values(in[r].ptr(), data[r], "rank " + std::to_string(r) + " input");
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      const std::string what = "rank " + std::to_string(r) + " from " + std::to_string(q);
      check_values(out[r][q].ptr(), data[q], what);
      CHECK_MSG(out[r][q].guard_intact(), what << ": bytes past the destination written");
      check_stream(cl->net.log[q][r], c.len[q], piece, c.tag, q, r);
    }
  }
  return cl;
}

TEST(exchange_copy_two_ranks) {
  // 1000 bytes in 64-byte pieces: 15 full pieces and a short one.
  run_copy({.size = 2, .len = {1000, 1000}});
}

TEST(exchange_copy_three_ranks_uneven_lengths) {
  // Each sender's span has its own length: a whole number of pieces, one short piece, less
  // than one piece.
  run_copy({.size = 3, .len = {640, 650, 17}});
}

TEST(exchange_copy_piece_not_multiple_of_payload) {
  // A 30-byte payload carries 7 floats: pieces are 28 bytes, never a split element.
  run_copy({.size = 3, .len = {404, 56, 4}, .es = 4, .max_payload = 30});
  // 8-byte elements: 24-byte pieces.
  run_copy({.size = 2, .len = {8 * 37, 8}, .es = 8, .max_payload = 30});
}

TEST(exchange_copy_bytes_any_length) {
  // Byte elements: lengths and pieces of any size.
  run_copy({.size = 3, .len = {1000, 1, 31}, .es = 1, .max_payload = 30});
  run_copy({.size = 2, .len = {30, 29}, .es = 1, .max_payload = 30});
}

TEST(exchange_copy_empty_spans) {
  // An empty span still sends exactly one zero-length message (check_stream counts them).
  auto cl = run_copy({.size = 3, .len = {0, 0, 0}, .tag = 3});
  for (int a = 0; a < 3; ++a)
    for (int b = 0; b < 3; ++b)
      if (a != b) CHECK_EQ(cl->net.log[a][b].size(), 1u);
}

TEST(exchange_copy_mixed_empty_and_full) {
  run_copy({.size = 3, .len = {0, 200, 0}, .es = 4, .max_payload = 64});
}

TEST(exchange_copy_capacity_one_retries) {
  // One message in flight per direction: most sends are refused and retried on later steps.
  auto cl = run_copy({.size = 3, .len = {1000, 999, 500}, .max_payload = 16, .capacity = 1});
  CHECK(cl->net.refused > 0);
}

TEST(exchange_copy_shuffled_step_order) {
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    auto cl = run_copy({.size = 3, .len = {300, 301, 302}, .max_payload = 32, .capacity = 2, .seed = seed});
    CHECK(cl->net.refused > 0);
  }
}

TEST(exchange_copy_large_span_publishes_early) {
  // 256 KiB in 4032-byte pieces (the shared-memory rings' payload at their smallest size):
  // with room for all of it, one step sends more than the early-flush threshold, so the
  // exchange publishes before it goes on to receive.
  auto cl = run_copy({.size = 2, .len = {256 << 10, 256 << 10}, .es = 4, .max_payload = 4032});
  CHECK(cl->comm[0]->flushes > 0);
  CHECK(cl->comm[1]->flushes > 0);
}

TEST(exchange_copy_broadcast_inactive_directions) {
  // Root 1 sends to both others; nothing else travels: an inactive direction sends and
  // expects no message at all.
  const int n = 3, root = 1;
  const size_t len = 333;
  std::mt19937_64 g(5);
  Cluster cl(n, 50);
  const auto data = random_bytes(len, g);
  std::vector<Buf> buf;
  for (int r = 0; r < n; ++r) {
    buf.emplace_back(len);
    if (r == root) buf[r].set(data);
  }
  for (int r = 0; r < n; ++r) {
    ExchangePlan p = blank_plan(n);
    p.tag = 11;
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      if (r == root) p.send[q] = buf[r].span();
      if (q == root) p.recv[q] = buf[r].span();
    }
    cl.start(r, std::move(p), 1, {buf[r].t});
  }
  REQUIRE(cl.run());
  CHECK_EQ(cl.net.queued(), 0u);
  for (int r = 0; r < n; ++r) {
    check_values(buf[r].ptr(), data, "rank " + std::to_string(r));
    CHECK(buf[r].guard_intact());
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      if (r == root) check_stream(cl.net.log[r][q], len, 50, 11, r, q);
      else CHECK_EQ(cl.net.log[r][q].size(), 0u);
    }
  }
}

TEST(exchange_copy_ring_shift) {
  // Each rank sends to its right neighbour only and receives from its left one only.
  const int n = 3;
  const size_t len = 160;
  std::mt19937_64 g(6);
  Cluster cl(n, 48, 1);
  std::vector<std::vector<uint8_t>> data(n);
  std::vector<Buf> in, out;
  for (int r = 0; r < n; ++r) {
    data[r] = random_bytes(len, g);
    in.emplace_back(len);
    in[r].set(data[r]);
    out.emplace_back(len);
  }
  for (int r = 0; r < n; ++r) {
    ExchangePlan p = blank_plan(n);
    p.send[(r + 1) % n] = in[r].span();
    p.recv[(r + n - 1) % n] = out[r].span();
    cl.start(r, std::move(p), 1, {in[r].t, out[r].t});
  }
  REQUIRE(cl.run());
  for (int r = 0; r < n; ++r) {
    const int left = (r + n - 1) % n, right = (r + 1) % n;
    check_values(out[r].ptr(), data[left], "rank " + std::to_string(r));
    CHECK(out[r].guard_intact());
    check_stream(cl.net.log[r][right], len, 48, 0, r, right);
    CHECK_EQ(cl.net.log[r][left].size(), 0u);
  }
}

// ---------------------------------------------------------------------------------------
// Fold mode: every rank's span reduced into one output, in group-rank order.

struct FoldCase {
  int size = 2;
  size_t n = 1001;  // elements
  size_t max_payload = 48;
  size_t capacity = 0;
  bool inplace = false;  // own, out and what is sent are one buffer (in-place all_reduce)
  RedOp op = RedOp::SUM;
  int divisor = 1;  // AVG
  uint64_t seed = 0;
};

template <typename T>
std::unique_ptr<Cluster> run_fold(const FoldCase& c) {
  const int n = c.size;
  const size_t bytes = c.n * sizeof(T);
  std::mt19937_64 g(2000 + c.seed + c.n);
  auto cl = std::make_unique<Cluster>(n, c.max_payload, c.capacity);
  std::vector<std::vector<T>> x(n);
  std::vector<Buf> in, out;
  for (int r = 0; r < n; ++r) {
    x[r] = random_values<T>(c.n, g);
    in.emplace_back(bytes);
    in[r].set(x[r]);
    out.emplace_back(c.inplace ? 0 : bytes);
  }
  for (int r = 0; r < n; ++r) {
    const Buf& dst = c.inplace ? in[r] : out[r];
    ExchangePlan p = blank_plan(n);
    p.tag = 2;
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      p.send[q] = in[r].span();
      p.recv[q].active = true;
    }
    p.fold = true;
    p.out = dst.span();
    p.own = in[r].ptr();
    p.send_aliases_out = c.inplace;
    p.dtype = dtype_of<T>();
    p.op = c.op;
    p.avg_divisor = c.divisor;
    cl->start(r, std::move(p), sizeof(T), {in[r].t, out[r].t});
  }
  if (!cl->run(c.seed)) return cl;
  CHECK_EQ(cl->net.queued(), 0u);
  std::vector<int> ranks(n);
  std::iota(ranks.begin(), ranks.end(), 0);
  const auto want = fold_reference(x, ranks, c.op, c.divisor);
  const size_t piece = piece_of(c.max_payload, sizeof(T));
  for (int r = 0; r < n; ++r) {
    const Buf& dst = c.inplace ? in[r] : out[r];
    const std::string what = "rank " + std::to_string(r);
    check_values(dst.as<T>(), want, what + " result");
    CHECK_MSG(dst.guard_intact(), what << ": bytes past the output written");
    if (!c.inplace) check_values(in[r].as<T>(), x[r], what + " input");
    for (int q = 0; q < n; ++q)
      if (q != r) check_stream(cl->net.log[r][q], bytes, piece, 2, r, q);
  }
  return cl;
}

// The float data must be order-sensitive, or the group-rank order checks nothing.
void check_order_matters(size_t n, uint64_t seed) {
  std::mt19937_64 g(2000 + seed + n);
  std::vector<std::vector<float>> x(3);
  for (auto& v : x) v = random_floats(n, g);
  const auto a = fold_reference(x, {0, 1, 2}, RedOp::SUM, 1);
  const auto b = fold_reference(x, {2, 1, 0}, RedOp::SUM, 1);
  CHECK_MSG(std::memcmp(a.data(), b.data(), n * sizeof(float)) != 0, "test data sums alike in any order");
}

TEST(exchange_fold_sum_float32_two_ranks) {
  run_fold<float>({.size = 2});
}

TEST(exchange_fold_sum_float32_three_ranks) {
  check_order_matters(1001, 0);
  run_fold<float>({.size = 3});
}

TEST(exchange_fold_sum_int64) {
  run_fold<int64_t>({.size = 2, .n = 501});
  run_fold<int64_t>({.size = 3, .n = 501});
}

TEST(exchange_fold_sum_double_three_ranks) {
  run_fold<double>({.size = 3, .n = 257, .max_payload = 40});
}

TEST(exchange_fold_inplace_float32) {
  // Three ranks: float SUM keeps the group-rank order through a piece-sized accumulator.
  run_fold<float>({.size = 3, .inplace = true});
  // Two ranks: own + peer equals peer + own, so the fold goes straight into the output.
  run_fold<float>({.size = 2, .inplace = true});
}

TEST(exchange_fold_inplace_int64) {
  // Order-independent: folded directly into the output, which is also what is sent.
  run_fold<int64_t>({.size = 3, .n = 500, .inplace = true});
  run_fold<int64_t>({.size = 2, .n = 500, .inplace = true});
}

TEST(exchange_fold_inplace_capacity_one) {
  // Sends lag behind: a piece may be folded (overwritten) only after it went to every peer,
  // or peers would receive partly reduced data and the sums would be wrong.
  for (uint64_t seed : {0, 1, 2, 3}) {
    auto a = run_fold<float>({.size = 3, .max_payload = 16, .capacity = 1, .inplace = true, .seed = seed});
    CHECK(a->net.refused > 0);
    auto b = run_fold<int64_t>({.size = 3, .n = 300, .max_payload = 16, .capacity = 1, .inplace = true, .seed = seed});
    CHECK(b->net.refused > 0);
    auto c = run_fold<float>({.size = 2, .max_payload = 16, .capacity = 1, .inplace = true, .seed = seed});
    CHECK(c->net.refused > 0);
  }
}

TEST(exchange_fold_not_inplace_capacity_one) {
  auto a = run_fold<float>({.size = 3, .max_payload = 20, .capacity = 1, .seed = 4});
  CHECK(a->net.refused > 0);
}

TEST(exchange_fold_avg_divisor) {
  // Each folded piece is divided by the plan's divisor, whatever the group size.
  run_fold<float>({.size = 3, .inplace = true, .op = RedOp::AVG, .divisor = 3});
  run_fold<float>({.size = 2, .op = RedOp::AVG, .divisor = 2});
  run_fold<float>({.size = 3, .op = RedOp::AVG, .divisor = 5});
  run_fold<double>({.size = 2, .n = 100, .inplace = true, .op = RedOp::AVG, .divisor = 7});
}

TEST(exchange_fold_max_float32) {
  run_fold<float>({.size = 3, .n = 333, .inplace = true, .op = RedOp::MAX});
}

TEST(exchange_fold_odd_piece_size) {
  // 30-byte payloads: 28-byte float pieces, 24-byte int64 pieces, the last piece short.
  run_fold<float>({.size = 3, .n = 101, .max_payload = 30});
  run_fold<float>({.size = 3, .n = 101, .max_payload = 30, .inplace = true});
  run_fold<int64_t>({.size = 3, .n = 37, .max_payload = 30, .inplace = true});
  // Less than one piece in all.
  run_fold<float>({.size = 2, .n = 3, .max_payload = 30, .inplace = true});
}

TEST(exchange_fold_empty) {
  // Nothing to fold still exchanges one zero-length message per direction (check_stream).
  auto a = run_fold<float>({.size = 3, .n = 0});
  auto b = run_fold<float>({.size = 2, .n = 0, .inplace = true});
  CHECK_EQ(a->net.log[0][1].size(), 1u);
  CHECK_EQ(b->net.log[1][0].size(), 1u);
}

TEST(exchange_fold_shuffled_step_order) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    run_fold<float>({.size = 3, .n = 257, .max_payload = 64, .capacity = 2, .inplace = true, .seed = seed});
    run_fold<float>({.size = 3, .n = 257, .max_payload = 64, .capacity = 3, .seed = seed});
  }
}

TEST(exchange_fold_baseline_kernels) {
  // The folds again with the portable build of the reduce loops (main picked the AVX2 one
  // where the CPU has it): both must give the reference's bits.
  struct Restore {
    ~Restore() { fastcomm::select_reduce_kernels(); }
  } restore;
  fastcomm::select_reduce_kernels(/*baseline=*/true);
  REQUIRE(std::string(fastcomm::reduce_kernels()) == "baseline");
  run_fold<float>({.size = 3, .n = 1001, .max_payload = 256});
  run_fold<float>({.size = 3, .n = 1001, .max_payload = 256, .inplace = true, .op = RedOp::AVG, .divisor = 3});
  run_fold<int64_t>({.size = 3, .n = 333, .max_payload = 256, .inplace = true});
  run_fold<double>({.size = 2, .n = 100, .max_payload = 256, .inplace = true});
}

TEST(exchange_fold_subset_of_peers) {
  // Rank 0 folds rank 2's span into its own (in place); rank 2 only sends; rank 1 takes no
  // part (every direction inactive) and finishes at once.
  const int n = 3;
  const size_t count = 211;
  std::mt19937_64 g(9);
  Cluster cl(n, 64, 1);
  std::vector<std::vector<float>> x(n);
  std::vector<Buf> buf;
  for (int r = 0; r < n; ++r) {
    x[r] = random_floats(count, g);
    buf.emplace_back(count * sizeof(float));
    buf[r].set(x[r]);
  }
  ExchangePlan p0 = blank_plan(n);
  p0.recv[2].active = true;
  p0.fold = true;
  p0.out = buf[0].span();
  p0.own = buf[0].ptr();
  p0.dtype = c10::ScalarType::Float;
  cl.start(0, std::move(p0), 4, {buf[0].t});
  cl.start(1, blank_plan(n), 4, {buf[1].t});
  ExchangePlan p2 = blank_plan(n);
  p2.send[0] = buf[2].span();
  cl.start(2, std::move(p2), 4, {buf[2].t});
  REQUIRE(cl.run());
  CHECK_EQ(cl.net.queued(), 0u);
  check_values(buf[0].as<float>(), fold_reference(x, {0, 2}, RedOp::SUM, 1), "rank 0");
  check_values(buf[1].as<float>(), x[1], "rank 1");
  check_values(buf[2].as<float>(), x[2], "rank 2");
  check_stream(cl.net.log[2][0], count * 4, 64, 0, 2, 0);
  size_t others = 0;
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b)
      if (!(a == 2 && b == 0)) others += cl.net.log[a][b].size();
  CHECK_EQ(others, 0u);
}

TEST(exchange_phases_reuse_one_exchange) {
  // One Exchange per rank runs three phases, as a multi-phase op does: a reduce-scatter fold
  // (each rank folds its chunk), an all-gather copy of the folded chunks, then an in-place
  // all_reduce fold of a second buffer. Ranks move on independently, so a peer's next-phase
  // messages queue behind this phase's; nothing of one phase may leak into the next.
  for (uint64_t seed : {0, 1, 2}) {
    const int n = 3;
    const size_t count = 1000, count2 = 77;
    std::mt19937_64 g(40 + seed);
    Cluster cl(n, 36, 2);
    std::vector<std::vector<float>> x(n), y(n);
    std::vector<Buf> a, b;
    for (int r = 0; r < n; ++r) {
      x[r] = random_floats(count, g);
      y[r] = random_floats(count2, g);
      a.emplace_back(count * 4);
      a[r].set(x[r]);
      b.emplace_back(count2 * 4);
      b[r].set(y[r]);
    }
    // Uneven chunks: 334, 333, 333 elements.
    const size_t bound[] = {0, 334, 667, count};
    auto chunk = [&](int r, int q) { return Span::of(a[r].ptr() + bound[q] * 4, (bound[q + 1] - bound[q]) * 4); };
    std::vector<int> phase(n, 0);
    auto build = [&](int r) {
      ExchangePlan p = blank_plan(n);
      p.tag = phase[r];
      for (int q = 0; q < n; ++q) {
        if (q == r) continue;
        if (phase[r] == 0) {
          p.send[q] = chunk(r, q);
          p.recv[q].active = true;
        } else if (phase[r] == 1) {
          p.send[q] = chunk(r, r);
          p.recv[q] = chunk(r, q);
        } else {
          p.send[q] = b[r].span();
          p.recv[q].active = true;
        }
      }
      p.dtype = c10::ScalarType::Float;
      if (phase[r] == 0) {
        p.fold = true;
        p.out = chunk(r, r);
        p.own = p.out.ptr;
      } else if (phase[r] == 2) {
        p.fold = true;
        p.out = b[r].span();
        p.own = b[r].ptr();
        p.send_aliases_out = true;
      }
      cl.start(r, std::move(p), 4, {a[r].t, b[r].t});
    };
    for (int r = 0; r < n; ++r) build(r);
    const bool ok = cl.run(seed, [&](int r) {
      if (phase[r] == 2) return false;
      ++phase[r];
      build(r);
      return true;
    });
    REQUIRE(ok);
    CHECK_EQ(cl.net.queued(), 0u);
    const auto want_a = fold_reference(x, {0, 1, 2}, RedOp::SUM, 1);
    const auto want_b = fold_reference(y, {0, 1, 2}, RedOp::SUM, 1);
    for (int r = 0; r < n; ++r) {
      check_values(a[r].as<float>(), want_a, "rank " + std::to_string(r) + " all_reduce via rs+ag");
      check_values(b[r].as<float>(), want_b, "rank " + std::to_string(r) + " second all_reduce");
      CHECK(a[r].guard_intact());
      CHECK(b[r].guard_intact());
    }
  }
}

// ---------------------------------------------------------------------------------------
// A piece that does not fit the receiver's plan is a typed error, not an assertion.

bool run_expecting_error(Cluster& cl, const std::string& needle) {
  try {
    cl.run();
  } catch (const c10::DistBackendError& e) {
    const std::string msg = e.what();
    return CHECK_MSG(msg.find(needle) != std::string::npos, "error message lacks '" << needle << "': " << msg);
  }
  return CHECK_MSG(false, "no DistBackendError");
}

TEST(exchange_tag_mismatch_throws) {
  Cluster cl(2, 64);
  Buf s0(100), s1(100), d0(100), d1(100);
  for (int r = 0; r < 2; ++r) {
    ExchangePlan p = blank_plan(2);
    p.tag = r == 0 ? 1 : 2;  // the ranks run different phases
    p.send[1 - r] = (r == 0 ? s0 : s1).span();
    p.recv[1 - r] = (r == 0 ? d0 : d1).span();
    cl.start(r, std::move(p), 1, {});
  }
  run_expecting_error(cl, "expects phase tag");
}

// pair_sizes (all_to_all): every pair's span lengths differ, some are empty; all arrive.
TEST(exchange_pair_sizes_uneven_lengths) {
  const int n = 3;
  const size_t es = 4;
  auto len = [](int a, int b) { return (size_t)((a * 5 + b * 3) % 4) * 24 * es; };  // bytes a sends b
  std::mt19937_64 g(9);
  Cluster cl(n, 40, 2);
  std::vector<std::vector<std::vector<uint8_t>>> data(n, std::vector<std::vector<uint8_t>>(n));
  std::vector<std::vector<Buf>> in(n), out(n);
  for (int r = 0; r < n; ++r)
    for (int q = 0; q < n; ++q) {
      data[r][q] = random_bytes(len(r, q), g);
      in[r].emplace_back(len(r, q));
      in[r][q].set(data[r][q]);
      out[r].emplace_back(len(q, r));
    }
  for (int r = 0; r < n; ++r) {
    ExchangePlan p = blank_plan(n);
    p.pair_sizes = true;
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      p.send[q] = in[r][q].span();
      p.recv[q] = out[r][q].span();
    }
    cl.start(r, std::move(p), es, {});
  }
  REQUIRE(cl.run(3));
  CHECK_EQ(cl.net.queued(), 0u);
  for (int r = 0; r < n; ++r)
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      const std::string what = "rank " + std::to_string(r) + " from " + std::to_string(q);
      check_values(out[r][q].ptr(), data[q][r], what);
      CHECK_MSG(out[r][q].guard_intact(), what << ": bytes past the destination written");
    }
}

// A pair that disagrees in one direction only fails on both sides: the receiver of the odd
// span by the sender's tag, the sender by the receiver's (which says what it expects).
TEST(exchange_pair_sizes_mismatch_fails_both_sides) {
  for (size_t longer : {0, 4, 100, 4000}) {
    Cluster cl(2, 64);
    Buf s0(100 + longer), d0(100), s1(100), d1(100);
    for (int r = 0; r < 2; ++r) {
      ExchangePlan p = blank_plan(2);
      p.pair_sizes = true;
      p.label = "rank " + std::to_string(r);
      p.send[1 - r] = (r == 0 ? s0 : s1).span();
      p.recv[1 - r] = (r == 0 ? d0 : d1).span();
      if (longer == 0 && r == 1) p.recv[0].len = 96;  // rank 1 expects fewer than rank 0 sends
      cl.start(r, std::move(p), 4, {});
    }
    std::vector<std::string> errs(2);
    for (int round = 0; round < 100 && (errs[0].empty() || errs[1].empty()); ++round)
      for (int r = 0; r < 2; ++r) {
        if (!errs[r].empty() || cl.ex[r].done()) continue;
        try {
          cl.ex[r].step(*cl.comm[r]);
        } catch (const c10::DistBackendError& e) {
          errs[r] = e.what();
        }
      }
    CHECK_MSG(errs[1].find("group rank 0 sends a different number") != std::string::npos,
              "rank 1 (longer " << longer << "): " << errs[1]);
    CHECK_MSG(errs[0].find("group rank 1 expects a different number") != std::string::npos,
              "rank 0 (longer " << longer << "): " << errs[0]);
    CHECK(!cl.ex[0].done() && !cl.ex[1].done());
  }
}

TEST(exchange_fold_length_mismatch_throws) {
  // Rank 0 sends 100 bytes where rank 1 folds 200: the second piece's length gives it away.
  Cluster cl(2, 64);
  Buf b0(100), b1(200);
  std::memset(b0.ptr(), 0, 100);
  std::memset(b1.ptr(), 0, 200);
  for (int r = 0; r < 2; ++r) {
    const Buf& b = r == 0 ? b0 : b1;
    ExchangePlan p = blank_plan(2);
    p.send[1 - r] = b.span();
    p.recv[1 - r].active = true;
    p.fold = true;
    p.out = b.span();
    p.own = b.ptr();
    p.send_aliases_out = true;
    p.dtype = c10::ScalarType::Float;
    cl.start(r, std::move(p), 4, {b.t});
  }
  run_expecting_error(cl, "offset 64");
}

}  // namespace
