#include "engine/driver.h"

#include <sched.h>

#include "common/errors.h"

namespace fastcomm {

namespace {

int usable_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return 1;
}

// The background thread ticks while async ops come and go, rather than being woken for each:
// a wake-up costs a futex call and, with more ranks than cores, a context switch per op, which
// the caller almost always makes moot by waiting at once. A tick costs the same, so while the
// ticks find nothing to drive (every op waited for by its caller) they slow down, doubling
// after every kBgSlowAfter such ticks up to kBgTickMax, and speed up again at the first one
// that drives (or a Future asked for, hurry()). After kBgIdle without an async op it sleeps
// until the next post wakes it.
constexpr auto kBgTick = std::chrono::microseconds(500);
constexpr auto kBgTickMax = std::chrono::microseconds(4000);
constexpr int kBgSlowAfter = 4;
constexpr auto kBgIdle = std::chrono::milliseconds(100);

}  // namespace

Driver::Driver(Progress& progress, int rank, int local_ranks, int64_t spin_ns, int64_t yield_ns)
    : progress_(progress), bell_(progress.bell()), rank_(rank), user_spin_(spin_ns >= 0), user_yield_(yield_ns >= 0) {
  // Spinning long pays only when every local rank has a core to itself; otherwise it steals
  // the time slice the peer needs to answer, so such a waiter polls only briefly (a peer that
  // runs on the other core answers within that) and then sleeps on the doorbell, which the
  // message it waits for rings. Not yield: EEVDF kernels charge a yielder's virtual runtime a
  // whole slice per sched_yield, so among ranks of one scheduling group (one session's
  // autogroup, where torch.multiprocessing.spawn leaves them) a rank that waits by yielding
  // loses its turns for milliseconds (docs/design.md, "Waiting").
  oversubscribed_ = local_ranks > usable_cpus();
  spin_ns_ = user_spin_ ? spin_ns : (oversubscribed_ ? 3000 : 200000);
  yield_ns_ = user_yield_ ? yield_ns : (oversubscribed_ ? 0 : 2000000);
}

void Driver::poll() {
  if (!progress_.try_progress(/*may_block=*/false) && oversubscribed_) sched_yield();
}

Driver::~Driver() { stop(); }

void Driver::prefer_sleep() {
  if (!user_spin_) spin_ns_ = 0;
  if (!user_yield_) yield_ns_ = 0;
}

void Driver::drive(Work* w, Clock::time_point user_deadline, bool has_deadline) {
  // Clocks are read from the first pass that finds nothing on (a blocking op in a pair needs
  // about one such pass in two; a read costs a few percent of the op). Unset: the epoch.
  Clock::time_point idle_since, last_health;
  uint32_t idle = 0;
  bool ran_out = false;   // the last sleep lasted its whole slice, nobody rang meanwhile
  uint32_t slept_on = 0;  // ... on this token
  for (;;) {
    if (w ? w->done() : (progress_.stopped() || progress_.pending_async() == 0 || fg_drivers_.load() > 0)) {
      // A pass on a transport thread may have settled Works whose Futures it left to a driver.
      Progress::Done none;
      progress_.finish(none);
      return;
    }
    const bool stalled = ran_out;
    ran_out = false;
    if (progress_.try_progress()) {
      if (stalled && bell_.token() == slept_on) stalled_sleeps_.fetch_add(1, std::memory_order_relaxed);
      idle = 0;
      continue;
    }
    if (idle++ == 0) {
      idle_since = Clock::now();
      if (last_health == Clock::time_point()) last_health = idle_since;
    }
    // A waiter that shares its core does not spin through passes here: the peer it waits for
    // may be the one that needs the core.
    if (!oversubscribed_ && (idle & 63) != 0 && idle < 4096) {
      cpu_relax();
      continue;
    }
    const auto now = Clock::now();
    const int64_t idle_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now - idle_since).count();
    if (idle_ns < spin_ns_) {
      cpu_relax();
      continue;
    }
    if (now - last_health >= std::chrono::milliseconds(20)) {
      last_health = now;
      progress_.health();
      if (w && w->done()) return;
    }
    if (has_deadline && now >= user_deadline)
      throw_comm_error("fastcomm: rank " + std::to_string(rank_) + ": Work.wait timed out" +
                       (w ? " on " + c10d::opTypeToString(w->retrieveOpType()) : std::string()) +
                       " (the op is still pending; it goes on)");
    if (idle_ns < spin_ns_ + yield_ns_) {
      sched_yield();
      continue;
    }
    if (progress_.stopped()) {
      // Shutdown fails every pending op in the section that stops progress, which this thread
      // may have seen before that section ended: waiting it out settles `w` first.
      if (w) progress_.sync();
      return;
    }
    bell_.begin_sleep();
    const uint32_t tok = bell_.token();
    // The last look before sleeping waits for the lock rather than giving up when another
    // thread holds it: that thread may have looked before the event this one was woken for
    // (ring space freed, say), and nobody rings for that again.
    const bool progressed = progress_.try_progress(/*may_block=*/true, /*wait_lock=*/true);
    // rerun is read after the token: a transport thread sets it before it rings, so either it
    // is seen here or the sleep returns at once. While set, a delivery may wait for a pass the
    // lock holder will not run: sleep only a short slice (not a spin, which would take the
    // holder's core).
    const bool rerun = progress_.rerun();
    if (!progressed && !(w && w->done())) {
      const int64_t slice = rerun ? 50000 : 5000000;
      const auto t0 = Clock::now();
      bell_.sleep(tok, slice);
      ran_out = !rerun && bell_.token() == tok && Clock::now() - t0 >= std::chrono::nanoseconds(slice);
      slept_on = tok;
    }
    bell_.end_sleep();
    if (progressed) idle = 0;
  }
}

void Driver::wait(Work& w, std::chrono::milliseconds timeout) {
  if (w.done()) return;
  fg_drivers_.fetch_add(1);
  struct Leave {
    std::atomic<int>& n;
    ~Leave() { n.fetch_sub(1); }  // async ops left pending: the ticking background thread takes over
  } leave{fg_drivers_};
  const bool has_deadline = timeout.count() > 0;
  drive(&w, has_deadline ? Clock::now() + timeout : Clock::time_point(), has_deadline);
  TORCH_INTERNAL_ASSERT(w.done(), "fastcomm: rank ", rank_, ": wait returned with the op pending");
}

void Driver::ensure_background() {
  if (bg_started_.load(std::memory_order_acquire) && !bg_deep_.load(std::memory_order_seq_cst))
    return;  // ticking: it will look within kBgTick
  std::lock_guard<std::mutex> lk(bg_mu_);
  if (!bg_stop_ && !bg_.joinable()) {  // (stop() joins or detaches bg_ once bg_stop_ is set)
    bg_ = std::thread([this] { bg_main(); });
    bg_started_.store(true, std::memory_order_release);
  }
  bg_cv_.notify_one();
}

void Driver::hurry() {
  {
    std::lock_guard<std::mutex> lk(bg_mu_);
    bg_hurry_ = true;
  }
  bg_cv_.notify_one();
}

bool Driver::held(const std::function<void()>& f) {
  std::shared_ptr<void> hold = owner_ ? owner_() : nullptr;
  const std::weak_ptr<void> alive = hold;
  f();
  if (!hold) return true;
  bool stopping;
  {
    std::lock_guard<std::mutex> lk(bg_mu_);
    stopping = bg_stop_;
  }
  // Stopped inside f (a callback shut the engine down on this thread, which stop() then
  // detached): once the hold goes, another thread may destroy the owner without waiting for
  // this one, so nothing of it is touched after.
  hold.reset();
  if (stopping) return false;
  // Not stopped: an owner destroyed elsewhere from now on joins this thread first. Expired:
  // that was the last reference, and the owner went on this thread (its stop() detached it).
  return !alive.expired();
}

void Driver::bg_main() {
  std::unique_lock<std::mutex> lk(bg_mu_);
  auto last_busy = Clock::now();
  auto tick = kBgTick;
  int idle_ticks = 0;
  auto idle_tick = [&] {
    if (++idle_ticks >= kBgSlowAfter && tick < kBgTickMax) {
      tick = std::min(tick * 2, kBgTickMax);
      idle_ticks = 0;
    }
  };
  while (!bg_stop_) {
    if (Clock::now() - last_busy > kBgIdle) {
      // A post that saw bg_deep_ false before this store finds pending_async raised here.
      bg_deep_.store(true, std::memory_order_seq_cst);
      bg_cv_.wait(lk, [&] { return bg_stop_ || progress_.pending_async() > 0; });
      bg_deep_.store(false, std::memory_order_seq_cst);
      tick = kBgTick;
      idle_ticks = 0;
    } else if (!bg_hurry_) {
      bg_cv_.wait_for(lk, tick);
    }
    if (bg_stop_) break;
    if (bg_hurry_) {
      bg_hurry_ = false;
      tick = kBgTick;
      idle_ticks = 0;
    }
    if (progress_.pending_async() == 0) {
      if (progress_.publish_pending()) {
        lk.unlock();
        if (!held([this] {
              Progress::Done none;
              progress_.finish(none);
            }))
          return;
        lk.lock();
      }
      idle_tick();
      continue;
    }
    last_busy = Clock::now();
    if (fg_drivers_.load() > 0) {
      idle_tick();
      continue;
    }
    tick = kBgTick;
    idle_ticks = 0;
    lk.unlock();
    if (!held([this] {
          try {
            drive(nullptr, Clock::time_point{}, false);
          } catch (...) {
            // Without a Work there is no user deadline; errors reach users through Works.
          }
        }))
      return;
    lk.lock();
    last_busy = Clock::now();
  }
}

void Driver::stop() {
  {
    std::lock_guard<std::mutex> lk(bg_mu_);
    bg_stop_ = true;
  }
  bg_cv_.notify_all();
  if (bg_.joinable()) {
    if (bg_.get_id() == std::this_thread::get_id()) bg_.detach();
    else bg_.join();
  }
}

}  // namespace fastcomm
