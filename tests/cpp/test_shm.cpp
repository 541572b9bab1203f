// Unit tests of the shared-memory rings (transport/shm): two ShmTransport objects in this one
// process play ranks 0 and 1 of a host. Each test uses a fresh random job token, so segment
// names never collide with another run, and checks that nothing of its job is left in
// /dev/shm afterwards.
#include <c10/util/Exception.h>
#include <dirent.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "transport/shm/transport.h"
#include "unit.h"

namespace {

using fastcomm::Doorbell;
using fastcomm::Header;
using fastcomm::Message;
using fastcomm::ShmTransport;

constexpr size_t kRing = 16384;  // the smallest ring the transport accepts
constexpr size_t kRecordHeader = 64;

size_t align64(size_t n) { return (n + 63) & ~size_t(63); }

std::string fresh_token() {
  static std::mt19937_64 g(std::random_device{}() ^ ((uint64_t)getpid() << 32));
  char buf[40];
  std::snprintf(buf, sizeof(buf), "ut%d-%016llx", (int)getpid(), (unsigned long long)g());
  return buf;
}

std::vector<std::string> shm_entries(const std::string& token) {
  std::vector<std::string> found;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d))
      if (std::strstr(e->d_name, token.c_str())) found.push_back(e->d_name);
    closedir(d);
  }
  return found;
}

// Ranks 0 and 1 of one host, attached to each other, names already unlinked (as after init).
struct ShmPair {
  std::unique_ptr<ShmTransport> t0, t1;
  ShmPair(const std::string& token, size_t ring, int stream) {
    const std::vector<int64_t> pids{getpid(), getpid()};
    t0 = std::make_unique<ShmTransport>(0, 2, token, std::vector<int>{0, 1}, pids, ring, stream);
    t1 = std::make_unique<ShmTransport>(1, 2, token, std::vector<int>{0, 1}, pids, ring, stream);
    // Both names exist until unlinked, so the emptiness checks below and after a test see
    // the unlinking, not a wrong directory.
    CHECK_EQ(shm_entries(token).size(), 2u);
    t0->attach_peers();
    t1->attach_peers();
    t0->unlink_own();
    t1->unlink_own();
    CHECK(shm_entries(token).empty());
  }
};

// Runs `body` on a fresh pair, then checks /dev/shm holds nothing of the pair's job.
void with_pair(const std::function<void(ShmTransport&, ShmTransport&)>& body, size_t ring = kRing,
               int stream = -1) {
  const std::string token = fresh_token();
  try {
    ShmPair p(token, ring, stream);
    body(*p.t0, *p.t1);
  } catch (...) {
    CHECK(shm_entries(token).empty());
    throw;
  }
  const auto left = shm_entries(token);
  CHECK_MSG(left.empty(), "left in /dev/shm: " << left[0]);
}

// A message whose every header field and payload byte derive from `seq`, so any mix-up of
// messages, fields or bytes shows.
Header header_for(uint64_t seq, uint32_t len) {
  Header h;
  h.group = 0x1000 + seq * 3;
  h.seq = seq;
  h.numel = seq * 7 + 1;
  h.offset = seq * 4096 + 5;
  h.len = len;
  h.tag = (uint32_t)(seq * 11 + 2);
  h.root = (int32_t)(seq % 5) - 1;
  h.kind = (uint8_t)(1 + seq % 7);
  h.dtype = (uint8_t)(seq % 13);
  h.redop = (uint8_t)(seq % 4);
  h.flags = (uint8_t)(seq % 3);
  return h;
}

std::vector<uint8_t> payload_for(uint64_t seq, uint32_t len) {
  std::vector<uint8_t> v(len);
  for (uint32_t i = 0; i < len; ++i) v[i] = (uint8_t)(seq * 131 + i * 7 + (i >> 8));
  return v;
}

bool send_msg(ShmTransport& t, int peer, uint64_t seq, uint32_t len) {
  const auto p = payload_for(seq, len);
  return t.try_send(peer, header_for(seq, len), len ? p.data() : nullptr);
}

// The message `m` must be exactly message `seq` of `len` bytes.
bool check_msg(const Message* m, uint64_t seq, uint32_t len) {
  if (!CHECK_MSG(m != nullptr, "message " << seq << " missing")) return false;
  const Header w = header_for(seq, len);
  bool ok = CHECK_EQ(m->hdr.seq, w.seq);
  ok &= CHECK_EQ(m->hdr.group, w.group);
  ok &= CHECK_EQ(m->hdr.numel, w.numel);
  ok &= CHECK_EQ(m->hdr.offset, w.offset);
  ok &= CHECK_EQ(m->hdr.len, w.len);
  ok &= CHECK_EQ(m->hdr.tag, w.tag);
  ok &= CHECK_EQ(m->hdr.root, w.root);
  ok &= CHECK_EQ(m->hdr.kind, w.kind);
  ok &= CHECK_EQ(m->hdr.dtype, w.dtype);
  ok &= CHECK_EQ(m->hdr.redop, w.redop);
  ok &= CHECK_EQ(m->hdr.flags, w.flags);
  if (!ok || len == 0) return ok;
  const auto p = payload_for(seq, len);
  for (uint32_t i = 0; i < len; ++i)
    if (m->data[i] != p[i])
      return CHECK_MSG(false, "message " << seq << " byte " << i << " is " << (int)m->data[i] << ", expected "
                                         << (int)p[i]);
  return true;
}

// Reads the next message from `peer` and checks it is `seq`.
bool recv_msg(ShmTransport& t, int peer, uint64_t seq, uint32_t len) {
  const bool ok = check_msg(t.peek(peer), seq, len);
  if (ok) t.pop(peer);
  return ok;
}

TEST(shm_messages_in_order_both_directions) {
  with_pair([](ShmTransport& a, ShmTransport& b) {
    CHECK(a.peek(1) == nullptr);
    CHECK(b.peek(0) == nullptr);
    const uint32_t lens[] = {1, 100, 64, 0, 65, 1000};
    for (uint64_t i = 0; i < 6; ++i) {
      REQUIRE(send_msg(a, 1, i, lens[i]));
      REQUIRE(send_msg(b, 0, 100 + i, lens[5 - i]));
    }
    a.flush();
    b.flush();
    for (uint64_t i = 0; i < 6; ++i) {
      REQUIRE(recv_msg(b, 0, i, lens[i]));
      REQUIRE(recv_msg(a, 1, 100 + i, lens[5 - i]));
    }
    CHECK(a.peek(1) == nullptr);
    CHECK(b.peek(0) == nullptr);
  });
}

TEST(shm_peek_is_stable_until_pop) {
  with_pair([](ShmTransport& a, ShmTransport& b) {
    REQUIRE(send_msg(a, 1, 1, 10));
    REQUIRE(send_msg(a, 1, 2, 20));
    a.flush();
    const Message* m1 = b.peek(0);
    const Message* m2 = b.peek(0);
    CHECK(check_msg(m1, 1, 10));
    CHECK(m1 == m2);  // peeking again returns the same message, not the next one
    b.pop(0);
    CHECK(recv_msg(b, 0, 2, 20));
  });
}

TEST(shm_invisible_until_flush) {
  with_pair([](ShmTransport& a, ShmTransport& b) {
    const Doorbell bell = b.doorbell();
    const uint32_t bell0 = bell.token();
    for (uint64_t i = 0; i < 5; ++i) REQUIRE(send_msg(a, 1, i, 50));
    CHECK(b.peek(0) == nullptr);
    a.flush();
    // Published, but nobody sleeps on b's doorbell: nobody is rung.
    CHECK_EQ(bell.token(), bell0);
    for (uint64_t i = 0; i < 5; ++i) REQUIRE(recv_msg(b, 0, i, 50));
    // With b asleep: one publish and one ring for the whole batch.
    bell.begin_sleep();
    for (uint64_t i = 5; i < 10; ++i) REQUIRE(send_msg(a, 1, i, 50));
    CHECK(b.peek(0) == nullptr);
    CHECK_EQ(bell.token(), bell0);
    a.flush();
    CHECK_EQ(bell.token(), bell0 + 1);
    // Nothing appended since: flush publishes nothing and rings nobody.
    a.flush();
    CHECK_EQ(bell.token(), bell0 + 1);
    bell.end_sleep();
    for (uint64_t i = 5; i < 10; ++i) REQUIRE(recv_msg(b, 0, i, 50));
    CHECK(b.peek(0) == nullptr);
    // Appended after a flush: invisible again until the next one.
    REQUIRE(send_msg(a, 1, 19, 3));
    CHECK(b.peek(0) == nullptr);
    a.flush();
    CHECK(recv_msg(b, 0, 19, 3));
  });
}

TEST(shm_zero_length_payload) {
  with_pair([](ShmTransport& a, ShmTransport& b) {
    REQUIRE(a.try_send(1, header_for(1, 0), nullptr));
    REQUIRE(send_msg(a, 1, 2, 33));
    REQUIRE(a.try_send(1, header_for(3, 0), nullptr));
    a.flush();
    CHECK(recv_msg(b, 0, 1, 0));
    CHECK(recv_msg(b, 0, 2, 33));
    CHECK(recv_msg(b, 0, 3, 0));
    CHECK(b.peek(0) == nullptr);
  });
}

TEST(shm_max_payload) {
  with_pair([](ShmTransport& a, ShmTransport& b) {
    const size_t mp = a.max_payload();
    // A record (header + payload) fits in a quarter of the ring, so several are in flight.
    CHECK(mp > 0);
    CHECK(kRecordHeader + align64(mp) <= kRing / 4);
    CHECK_EQ(mp, b.max_payload());
    REQUIRE(send_msg(a, 1, 1, (uint32_t)mp));
    REQUIRE(send_msg(a, 1, 2, (uint32_t)mp - 1));
    a.flush();
    CHECK(recv_msg(b, 0, 1, (uint32_t)mp));
    CHECK(recv_msg(b, 0, 2, (uint32_t)mp - 1));
    // Larger than max_payload is a caller bug, caught before it touches the ring.
    const std::vector<uint8_t> big(mp + 1, 1);
    CHECK_THROWS(a.try_send(1, header_for(3, (uint32_t)mp + 1), big.data()), c10::Error);
    a.flush();
    CHECK(b.peek(0) == nullptr);
  });
}

// Large payloads take the non-temporal copy when forced (1), never (0), or when plain copies run
// slow (-1): the bytes arrive the same, from sources at any alignment and of any length.
TEST(shm_large_payloads_every_copy_mode) {
  for (int stream : {1, 0, -1}) {
    with_pair(
        [&](ShmTransport& a, ShmTransport& b) {
          const uint32_t mp = (uint32_t)a.max_payload();
          REQUIRE(mp >= 128 * 1024);
          uint64_t seq = 0;
          for (uint32_t len : {65536u, 65536u + 13, 100000u + 7, mp - 1, mp}) {
            for (size_t shift : {0, 1, 8, 33}) {
              const auto p = payload_for(seq, len);
              std::vector<uint8_t> src(len + shift);
              std::memcpy(src.data() + shift, p.data(), len);
              REQUIRE(a.try_send(1, header_for(seq, len), src.data() + shift));
              a.flush();
              const bool ok = recv_msg(b, 0, seq, len);
              CHECK_MSG(ok, "copy mode " << stream << ", " << len << " bytes, source +" << shift);
              if (!ok) return;
              ++seq;
            }
          }
          CHECK(b.peek(0) == nullptr);
        },
        1 << 20, stream);
  }
}

TEST(shm_full_ring_refuses_then_frees) {
  with_pair([](ShmTransport& a, ShmTransport& b) {
    const uint32_t mp = (uint32_t)a.max_payload();
    const size_t fit = kRing / (kRecordHeader + align64(mp));
    REQUIRE(fit >= 2);
    uint64_t seq = 0;
    for (; seq < fit; ++seq) REQUIRE(send_msg(a, 1, seq, mp));
    // Full: refused, even with a small record, and it stays refused while nobody reads.
    CHECK(!send_msg(a, 1, seq, mp));
    CHECK(!send_msg(a, 1, seq, 0));
    a.flush();
    CHECK(!send_msg(a, 1, seq, mp));
    // The refused sender asked to be rung when space appears: the receiver's pop rings it.
    const uint32_t bell = a.doorbell().token();
    REQUIRE(recv_msg(b, 0, 0, mp));
    CHECK_EQ(a.doorbell().token(), bell + 1);
    CHECK(send_msg(a, 1, seq, mp));
    ++seq;
    CHECK(!send_msg(a, 1, seq, mp));  // full again
    // Without a refusal since, popping rings nobody.
    a.flush();
    REQUIRE(recv_msg(b, 0, 1, mp));
    const uint32_t bell2 = a.doorbell().token();
    REQUIRE(recv_msg(b, 0, 2, mp));
    CHECK_EQ(a.doorbell().token(), bell2);
    for (uint64_t i = 3; i < seq; ++i) REQUIRE(recv_msg(b, 0, i, mp));
    CHECK(b.peek(0) == nullptr);
  });
}

TEST(shm_many_messages_wrap_around) {
  // Far more bytes than the ring holds, in records of many sizes (so the wrap point falls
  // anywhere, including where only a record header fits), written as fast as the ring allows
  // and read back in uneven batches.
  with_pair([](ShmTransport& a, ShmTransport& b) {
    const uint32_t mp = (uint32_t)a.max_payload();
    auto len_of = [mp](uint64_t s) -> uint32_t {
      switch (s % 7) {
        case 0: return 0;
        case 1: return mp;
        default: return (uint32_t)((s * 389) % mp);
      }
    };
    const uint64_t total = 3000;
    uint64_t sent = 0, received = 0, refusals = 0, bytes = 0;
    for (int round = 0; received < total && round < 100000; ++round) {
      while (sent < total && send_msg(a, 1, sent, len_of(sent))) bytes += len_of(sent++);
      if (sent < total) ++refusals;
      a.flush();
      // Read 1, 2, 3, ... messages per round, or all that are there.
      for (int k = 0; k <= round % 5 && received < sent; ++k, ++received)
        if (!recv_msg(b, 0, received, len_of(received))) return;
    }
    CHECK_EQ(received, total);
    CHECK(bytes > 20 * kRing);
    CHECK(refusals > 0);
    CHECK(b.peek(0) == nullptr);
  });
}

TEST(shm_a_payload_that_forges_a_record_is_not_taken_for_one) {
  // A record that does not fit before the ring's end goes to its start; the bytes it skipped
  // hold an earlier pass's payload. Here that payload holds, where the reader looks next, a
  // record header with the reader's own position: the reader must take the sender's skip, not
  // the forged record.
  with_pair([](ShmTransport& a, ShmTransport& b) {
    const uint32_t mp = (uint32_t)a.max_payload();
    REQUIRE(kRecordHeader + align64(mp) == kRing / 4);
    static_assert(sizeof(Header) + 16 == kRecordHeader, "record layout: header, pos, pad");
    // Pass 1: four full records; the fourth's payload begins at ring offset 3/4 R + 64.
    const uint64_t forged_at = 3 * kRing / 4 + kRecordHeader;
    std::vector<uint8_t> forged(mp, 0);
    const Header fake = header_for(999, 64);
    const uint64_t reader_pos = kRing + forged_at;  // where the reader is in pass 2
    std::memcpy(forged.data(), &fake, sizeof(fake));
    std::memcpy(forged.data() + sizeof(fake), &reader_pos, sizeof(reader_pos));
    for (uint64_t s = 0; s < 3; ++s) REQUIRE(send_msg(a, 1, s, mp));
    REQUIRE(a.try_send(1, header_for(3, mp), forged.data()));
    a.flush();
    for (uint64_t s = 0; s < 3; ++s) REQUIRE(recv_msg(b, 0, s, mp));
    REQUIRE(b.peek(0) != nullptr);
    b.pop(0);
    // Pass 2: records up to `forged_at`, then one that does not fit there.
    const uint32_t lens[] = {mp, mp, (uint32_t)(kRing / 8 - kRecordHeader), (uint32_t)(kRing / 8)};
    uint64_t s = 10;
    for (uint32_t len : lens) REQUIRE(send_msg(a, 1, s++, len));
    a.flush();
    s = 10;
    for (uint32_t len : lens) REQUIRE(recv_msg(b, 0, s++, len));
    REQUIRE(send_msg(a, 1, s, mp));
    a.flush();
    REQUIRE(recv_msg(b, 0, s, mp));
    CHECK(b.peek(0) == nullptr);
  });
}

TEST(shm_bursts_read_back_in_part) {
  // Bursts of 1-4 records of random sizes, each read back entirely or in part before the next
  // burst, put the write position everywhere and make the reader skip slots at the ring's end
  // that hold records of earlier passes.
  with_pair([](ShmTransport& a, ShmTransport& b) {
    const uint32_t mp = (uint32_t)a.max_payload();
    std::mt19937_64 g(7);
    uint64_t sent = 0, received = 0;
    std::vector<uint32_t> lens;
    for (int round = 0; round < 4000; ++round) {
      const int burst = 1 + (int)(g() % 4);
      for (int k = 0; k < burst; ++k) {
        const uint32_t len = g() % 5 == 0 ? (uint32_t)(g() % (mp + 1)) : (uint32_t)(g() % 700);
        if (!send_msg(a, 1, sent, len)) break;
        lens.push_back(len);
        ++sent;
      }
      a.flush();
      // Mostly drain the ring (the sender then finds it empty), sometimes leave records in it.
      const uint64_t keep = g() % 3 == 0 ? g() % 2 : 0;
      for (; received + keep < sent; ++received)
        if (!recv_msg(b, 0, received, lens[received])) return;
    }
    for (; received < sent; ++received)
      if (!recv_msg(b, 0, received, lens[received])) return;
    CHECK_MSG(sent > 6000, sent << " sent");
    CHECK(b.peek(0) == nullptr);
  });
}

// Minor page faults this process has taken so far.
long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

TEST(shm_first_message_maps_the_ring_in) {
  // The first message to a peer maps its whole (1 MiB) ring in on both sides at once; the
  // first lap then takes no page faults (it took one per 4 KB on each side: 512 here).
  utsname u{};
  int major = 0, minor = 0;
  if (uname(&u) == 0) std::sscanf(u.release, "%d.%d", &major, &minor);
  if (major < 5 || (major == 5 && minor < 14)) return;  // no MADV_POPULATE_*: pages fault in as before
  with_pair(
      [](ShmTransport& a, ShmTransport& b) {
        const uint32_t len = 400;  // records of 512 bytes: 2,048 in a lap
        REQUIRE(send_msg(a, 1, 0, len));
        a.flush();
        REQUIRE(recv_msg(b, 0, 0, len));
        const std::vector<uint8_t> p = payload_for(1, len);
        const long before = minor_faults();
        for (uint64_t i = 1; i < 2048; ++i) {
          REQUIRE(a.try_send(1, header_for(1, len), p.data()));
          a.flush();
          const Message* m = b.peek(0);
          REQUIRE(m != nullptr && m->hdr.len == len);
          b.pop(0);
        }
        const long faults = minor_faults() - before;
        CHECK_MSG(faults < 16, faults << " page faults in the ring's first lap");
      },
      1 << 20);
}

TEST(shm_both_directions_interleaved) {
  // Each side sends and receives in the same rounds: the two rings are independent.
  with_pair([](ShmTransport& a, ShmTransport& b) {
    const uint64_t total = 500;
    uint64_t sa = 0, sb = 0, ra = 0, rb = 0;
    for (int round = 0; (ra < total || rb < total) && round < 100000; ++round) {
      while (sa < total && send_msg(a, 1, sa, (uint32_t)(sa * 97 % 2000))) ++sa;
      while (sb < total && send_msg(b, 0, 10000 + sb, (uint32_t)(sb * 53 % 3000))) ++sb;
      a.flush();
      b.flush();
      for (int k = 0; k < 3 && rb < sa; ++k, ++rb)
        if (!recv_msg(b, 0, rb, (uint32_t)(rb * 97 % 2000))) return;
      for (int k = 0; k < 2 && ra < sb; ++k, ++ra)
        if (!recv_msg(a, 1, 10000 + ra, (uint32_t)(ra * 53 % 3000))) return;
    }
    CHECK_EQ(ra, total);
    CHECK_EQ(rb, total);
  });
}

TEST(shm_release_peer) {
  // After release_peer (the peer exited) nothing reaches it and nothing is read from it, even
  // what was appended or published before.
  with_pair([](ShmTransport& a, ShmTransport& b) {
    REQUIRE(send_msg(b, 0, 1, 10));
    b.flush();
    REQUIRE(send_msg(a, 1, 2, 10));  // appended, not yet published
    a.release_peer(1);
    CHECK(a.peek(1) == nullptr);
    CHECK(!send_msg(a, 1, 3, 10));
    a.flush();  // must not touch the released ring
    CHECK(b.peek(0) == nullptr);
    // The other side is unaffected.
    REQUIRE(send_msg(b, 0, 4, 10));
    b.flush();
  });
}

TEST(shm_unlink_is_idempotent) {
  with_pair([](ShmTransport& a, ShmTransport& b) {
    a.unlink_own();
    b.unlink_own();
    // The mappings outlive the names: traffic still flows.
    REQUIRE(send_msg(a, 1, 5, 70));
    a.flush();
    CHECK(recv_msg(b, 0, 5, 70));
  });
}

TEST(shm_attach_rejects_foreign_segment) {
  const std::string token = fresh_token();
  {
    // Rank 1 expects another process as rank 0: the segment under rank 0's name is not ours.
    ShmTransport t0(0, 2, token, {0, 1}, {getpid(), getpid()}, kRing);
    ShmTransport t1(1, 2, token, {0, 1}, {getpid() + 1000000, getpid()}, kRing);
    try {
      t1.attach_peers();
      CHECK_MSG(false, "attach_peers accepted a segment of another pid");
    } catch (const c10::DistBackendError& e) {
      CHECK_MSG(std::strstr(e.what(), "does not belong to this job") != nullptr, e.what());
    }
  }
  CHECK(shm_entries(token).empty());  // the destructors unlink what init left
}

TEST(shm_attach_rejects_other_ring_size) {
  const std::string token = fresh_token();
  {
    ShmTransport t0(0, 2, token, {0, 1}, {getpid(), getpid()}, kRing);
    ShmTransport t1(1, 2, token, {0, 1}, {getpid(), getpid()}, 2 * kRing);
    try {
      t1.attach_peers();
      CHECK_MSG(false, "attach_peers accepted a segment of another size");
    } catch (const c10::DistBackendError& e) {
      CHECK_MSG(std::strstr(e.what(), "unexpected size") != nullptr, e.what());
    }
  }
  CHECK(shm_entries(token).empty());
}

TEST(shm_rejects_small_ring) {
  const std::string token = fresh_token();
  CHECK_THROWS((ShmTransport(0, 2, token, {0, 1}, {getpid(), getpid()}, 4096)), c10::ValueError);
  CHECK(shm_entries(token).empty());
}

TEST(shm_peer_alive) {
  // One child through its lifetime: running, exited but not reaped (a zombie still answers
  // kill(), so /proc decides), reaped (kill() says ESRCH).
  int pipefd[2];
  REQUIRE(pipe(pipefd) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    close(pipefd[1]);
    char c;
    while (read(pipefd[0], &c, 1) > 0) {
    }
    _exit(0);  // parent closed the pipe
  }
  close(pipefd[0]);
  const std::string token = fresh_token();
  {
    // Rank 0 here; rank 1 the child (on another "host": not in local_ranks, never attached);
    // rank 2 of unknown pid.
    ShmTransport t(0, 3, token, {0}, {getpid(), child, 0}, kRing);
    t.unlink_own();
    CHECK(t.peer_alive(0));
    CHECK(t.peer_alive(2));  // no pid known: assumed alive
    CHECK(t.peer_alive(1));
    close(pipefd[1]);
    siginfo_t info{};
    REQUIRE(waitid(P_PID, child, &info, WEXITED | WNOWAIT) == 0);  // exited, left unreaped
    CHECK(!t.peer_alive(1));
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    CHECK(!t.peer_alive(1));
  }
  CHECK(shm_entries(token).empty());
}

TEST(shm_peer_alive_attached) {
  // The same with the child attached as a local rank: its liveness then comes from its pidfd
  // (the process itself, not a pid that another may take once it is reaped).
  int up[2], down[2];
  REQUIRE(pipe(up) == 0 && pipe(down) == 0);
  const std::string token = fresh_token();
  const pid_t parent = getpid();
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    close(up[0]);
    close(down[1]);
    {
      ShmTransport t(1, 2, token, {0, 1}, {parent, getpid()}, kRing);
      char c = 1;
      if (write(up[1], &c, 1) != 1) _exit(1);
      while (read(down[0], &c, 1) > 0) {
      }
    }
    _exit(0);  // the parent closed the pipe; the segment's name was unlinked by the parent
  }
  close(up[1]);
  close(down[0]);
  char c;
  REQUIRE(read(up[0], &c, 1) == 1);  // the child's segment exists
  {
    ShmTransport t(0, 2, token, {0, 1}, {parent, child}, kRing);
    t.attach_peers();
    t.unlink_local_segments();
    CHECK(t.peer_alive(1));
    close(down[1]);
    siginfo_t info{};
    REQUIRE(waitid(P_PID, child, &info, WEXITED | WNOWAIT) == 0);
    CHECK(!t.peer_alive(1));
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(!t.peer_alive(1));
  }
  close(up[0]);
  CHECK(shm_entries(token).empty());
}

}  // namespace
