// Unit tests of Exchange (algorithms/exchange.h) in copy mode: every rank sends its span to every
// other (all_gather), over the fake group of exchange_cluster.h.
#include "exchange_cluster.h"
#include "unit.h"

namespace {

using namespace exchange_test;

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

}  // namespace
