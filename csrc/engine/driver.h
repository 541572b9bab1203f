#pragma once
// Driving progress while waiting. The thread that waits for a Work runs the passes itself:
// it polls (spin), then yields, then sleeps on the doorbell in short slices, so that a
// blocking op costs microseconds when peers answer fast and no CPU when they do not. Async ops
// that nobody waits on are driven by one background thread, started at the first async op.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "engine/progress.h"

namespace fastcomm {

class Driver {
 public:
  // `spin_ns`/`yield_ns`: the waiting policy; -1 picks by whether the local ranks outnumber
  // the cores (`local_ranks`).
  Driver(Progress& progress, int rank, int local_ranks, int64_t spin_ns, int64_t yield_ns);
  ~Driver();

  // Blocks until `w` is done or `timeout` (0: none) passes, which throws.
  void wait(Work& w, std::chrono::milliseconds timeout);
  // Peers on other hosts answer through transport threads, which a spinning or yielding
  // waiter starves of CPU: sleep almost at once, unless the user chose the policy.
  void prefer_sleep();
  // How many steps a blocking op may spin through before it is queued
  // (Progress::step_alone_locked): none when waiters should not spin.
  int alone_spins() const { return spin_ns_ > 0 ? kAloneSpins : 0; }
  // One pass for Work.is_completed(). One that finds nothing to do yields the core when the
  // local ranks outnumber the cores: a caller looping on is_completed() would otherwise keep
  // it for a whole time slice while the peers it waits for cannot run.
  void poll();
  // After an async post: makes sure the background thread will look.
  void ensure_background();
  void wake_background() { bg_cv_.notify_one(); }
  // Makes the background thread look now and tick at its fastest again.
  void hurry();
  // Stops and joins the background thread (or detaches it, if called on it).
  void stop();
  // A strong reference to the driver's owner (null once it is being destroyed). The background
  // thread holds one while it drives: a Future callback there may drop the owner's last other
  // reference (fastcomm.shutdown() from a callback), and the owner must not die under it.
  void set_owner(std::function<std::shared_ptr<void>()> owner) { owner_ = std::move(owner); }
  // Sleeps that ran their whole slice with nobody ringing, after which there was work to do:
  // lost wake-ups, or work that came just as the slice ended. A diagnostic, not asserted on.
  uint64_t stalled_sleeps() const { return stalled_sleeps_.load(std::memory_order_relaxed); }

 private:
  // Drives until `w` is done (null: while async ops are pending and no waiter drives).
  void drive(Work* w, Clock::time_point user_deadline, bool has_deadline);
  void bg_main();
  // Runs `f` holding the owner; false if the owner died when it was let go (return at once).
  bool held(const std::function<void()>& f);

  static constexpr int kAloneSpins = 128;
  Progress& progress_;
  const Doorbell bell_;
  const int rank_;
  const bool user_spin_, user_yield_;
  bool oversubscribed_;
  int64_t spin_ns_, yield_ns_;
  std::atomic<int> fg_drivers_{0};
  std::atomic<uint64_t> stalled_sleeps_{0};
  std::mutex bg_mu_;
  std::condition_variable bg_cv_;
  std::thread bg_;
  bool bg_stop_ = false;
  bool bg_hurry_ = false;  // bg_mu_
  std::atomic<bool> bg_started_{false};
  std::atomic<bool> bg_deep_{false};  // asleep until rung, not ticking
  std::function<std::shared_ptr<void>()> owner_;  // set before the background thread starts
};

}  // namespace fastcomm
