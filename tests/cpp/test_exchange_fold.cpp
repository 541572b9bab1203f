// Unit tests of Exchange (algorithms/exchange.h) in fold mode (every rank's span reduced into one
// output, in group-rank order), its phases, and the typed errors of a piece that does not fit the
// receiver's plan; over the fake group of exchange_cluster.h.
#include "exchange_cluster.h"
#include "unit.h"

namespace {

using namespace exchange_test;

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
