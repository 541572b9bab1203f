#pragma once
// Doorbell: the one word a process sleeps on. Peers (and local threads) ring it after they
// make something observable for this process: a message in a ring, space freed in a ring, an
// op completed. Ringing is one atomic add on a shared cache line; the futex syscall is paid
// only when the sleepers count says someone is actually asleep. A peer publishing messages
// skips even the add unless the owner sleeps (wake_if_sleeping), so the hot path of a
// spinning receiver costs no syscall and loses no line to the sender.
//
// Lost-wakeup argument: a sleeper increments `sleepers`, reads `word` (token), re-checks for
// work, then futex-waits on (word == token). A ringer increments `word`, then reads
// `sleepers`. Both sides use seq_cst, so either the ringer sees the sleeper (and wakes it) or
// the sleeper's token already includes the ring (and futex_wait returns at once).
#include <atomic>
#include <cstdint>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

namespace fastcomm {

struct alignas(64) DoorbellWords {
  std::atomic<uint32_t> word{0};
  char pad0[60];
  std::atomic<uint32_t> sleepers{0};
  char pad1[60];
};
static_assert(sizeof(DoorbellWords) == 128, "doorbell layout");

class Doorbell {
 public:
  Doorbell() = default;
  explicit Doorbell(DoorbellWords* w) : w_(w) {}
  bool valid() const { return w_ != nullptr; }

  void ring() const {
    w_->word.fetch_add(1, std::memory_order_seq_cst);
    if (w_->sleepers.load(std::memory_order_seq_cst) != 0) {
      // Not FUTEX_PRIVATE: the word may live in memory shared with other processes.
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&w_->word), FUTEX_WAKE, INT32_MAX, nullptr,
              nullptr, 0);
    }
  }
  // After publishing something to the bell's owner (a peer process): wakes it only if it
  // sleeps, so a spinning owner's line is not taken from it per message. The fence orders the
  // publication before the read of `sleepers`; a sleeper raises `sleepers` (a full barrier)
  // before its last look for work, so either that look sees the publication or this read
  // sees the sleeper.
  void wake_if_sleeping() const {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (w_->sleepers.load(std::memory_order_seq_cst) != 0) ring();
  }
  // For local wake-ups (another thread of this process): skip the add when nobody sleeps.
  void ring_if_sleeping() const {
    if (w_ != nullptr && w_->sleepers.load(std::memory_order_seq_cst) != 0) ring();
  }
  uint32_t token() const { return w_->word.load(std::memory_order_seq_cst); }

  // Sleep protocol in three calls so the caller can re-check for work in between:
  //   begin_sleep(); tok = token(); if (!work()) sleep(tok, ns); end_sleep();
  void begin_sleep() const { w_->sleepers.fetch_add(1, std::memory_order_seq_cst); }
  void end_sleep() const { w_->sleepers.fetch_sub(1, std::memory_order_seq_cst); }
  void sleep(uint32_t tok, int64_t ns) const {
    struct timespec ts;
    ts.tv_sec = ns / 1000000000LL;
    ts.tv_nsec = ns % 1000000000LL;
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&w_->word), FUTEX_WAIT, tok, &ts, nullptr, 0);
  }

 private:
  DoorbellWords* w_ = nullptr;
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace fastcomm
