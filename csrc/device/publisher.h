#pragma once
// Completes the Futures of settled device Works off the engine thread (a callback may wait for
// another device op, which only the engine thread can launch). Two lanes:
// - the Futures of ops issued elsewhere, one at a time in settle order, as on the host path, so
//   ops that their callbacks issue are issued in one order on every rank (callbacks side by side
//   issued them in any order, and they met the wrong ops of the peer);
// - the Futures of ops a callback issued (`nested`), each on a thread free at the time: the
//   callback may wait for one (DDP's PowerSGD hook does) while it holds the first lane.
// Each is completed inside `around` (Runtime::on_idle_stream: the device and stream its events
// and callbacks see).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/work.h"

namespace fastcomm {
namespace device {

class Publisher {
 public:
  using Around = std::function<void(const std::function<void()>&)>;
  explicit Publisher(Around around) : st_(std::make_shared<State>(std::move(around))) {}
  ~Publisher() { stop(); }
  // Whether this thread is inside a callback of ours: an op issued here is `nested`.
  static bool on_callback_thread() { return tl_publishing(); }
  void push(c10::intrusive_ptr<Work> w, bool nested) {
    std::unique_lock<std::mutex> lk(st_->mu);
    if (st_->stop) {  // (after teardown nothing pushes; a late one is still completed)
      lk.unlock();
      publish(*st_, std::move(w));
      return;
    }
    Lane& lane = st_->lanes[nested ? 1 : 0];
    lane.queue.push_back(std::move(w));
    // The ordered lane has one thread; the nested one a thread for each queued Future that no
    // idle thread will take (an idle one counts as idle until it wakes).
    if (nested ? (size_t)lane.idle < lane.queue.size() : lane.threads == 0) {
      ++lane.threads;
      ++st_->running;
      threads_.emplace_back([st = st_, nested] { loop(st, nested ? 1 : 0); });
    }
    st_->cv.notify_all();
  }
  // Publishes what is still queued on the caller's thread once the idle threads have ended (by
  // then every op is settled, so no callback waits long). A thread inside a publish is detached,
  // not joined: its callback may itself be waiting for the caller (fastcomm.shutdown() from a
  // callback, or the engine's last reference dropped there). It touches only the shared state
  // afterwards, and takes nothing more from the queues.
  void stop() {
    std::unique_lock<std::mutex> lk(st_->mu);
    st_->stop = true;
    st_->cv.notify_all();
    for (;;) {
      st_->cv.wait(lk, [&] { return st_->running == st_->busy; });
      // Nested first: a callback still running (detached below) may wait for one.
      Lane* lane = !st_->lanes[1].queue.empty() ? &st_->lanes[1] : !st_->lanes[0].queue.empty() ? &st_->lanes[0] : nullptr;
      if (lane == nullptr) break;
      auto w = std::move(lane->queue.front());
      lane->queue.pop_front();
      lk.unlock();
      publish(*st_, std::move(w));
      lk.lock();
    }
    std::vector<std::thread> threads;
    threads.swap(threads_);
    std::vector<std::thread::id> busy = st_->busy_ids;
    lk.unlock();
    for (auto& t : threads) {
      if (t.get_id() == std::this_thread::get_id() || std::find(busy.begin(), busy.end(), t.get_id()) != busy.end())
        t.detach();
      else
        t.join();
    }
  }

 private:
  struct Lane {
    std::deque<c10::intrusive_ptr<Work>> queue;
    int threads = 0;  // not yet returned from loop()
    int idle = 0;
  };
  struct State {
    explicit State(Around a) : around(std::move(a)) {}
    const Around around;
    std::mutex mu;
    std::condition_variable cv;
    Lane lanes[2];
    std::vector<std::thread::id> busy_ids;  // threads inside publish()
    int running = 0;                        // threads of both lanes not yet returned from loop()
    int busy = 0;
    bool stop = false;
  };

  static bool& tl_publishing() {
    thread_local bool on = false;
    return on;
  }

  // Completes `w`'s Future; its last reference (and so possibly the engine's) is dropped inside.
  static void publish(State& st, c10::intrusive_ptr<Work> w) {
    bool& on = tl_publishing();
    const bool was = on;
    on = true;
    try {
      st.around([&] {
        auto mine = std::move(w);
        mine->publish();
      });
    } catch (...) {
      // (A callback's own error: the Future is completed by then; nothing here to tell.)
    }
    on = was;
  }

  static void loop(std::shared_ptr<State> st, int which) {
    Lane& lane = st->lanes[which];
    std::unique_lock<std::mutex> lk(st->mu);
    for (;;) {
      if (st->stop) break;
      if (!lane.queue.empty()) {
        auto w = std::move(lane.queue.front());
        lane.queue.pop_front();
        ++st->busy;
        st->busy_ids.push_back(std::this_thread::get_id());
        lk.unlock();
        publish(*st, std::move(w));
        lk.lock();
        --st->busy;
        st->busy_ids.erase(std::find(st->busy_ids.begin(), st->busy_ids.end(), std::this_thread::get_id()));
        continue;
      }
      ++lane.idle;
      st->cv.wait(lk);
      --lane.idle;
    }
    --lane.threads;
    --st->running;
    st->cv.notify_all();
  }

  std::shared_ptr<State> st_;
  std::vector<std::thread> threads_;  // touched by push and stop only (the engine's thread)
};

// Runs communicator aborts and destroys, and the release of ended IPC links' memory, off the
// engine thread: each can block for seconds (NCCL's ncclCommAbort and finalize; a cudaFree waits
// for the device), and the engine thread drives every other channel meanwhile. Each job gets a
// thread of its own, so a teardown's run side by side; stop() joins them.
class Aborter {
 public:
  ~Aborter() { stop(); }
  void push(std::function<void()> f) {
    std::lock_guard<std::mutex> lk(mu_);
    // Threads whose abort is over are joined here, so a long run does not collect them.
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      if (!it->done->load()) {
        ++it;
        continue;
      }
      it->thread.join();
      it = jobs_.erase(it);
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    jobs_.push_back(Job{std::thread([f = std::move(f), done] {
                          f();
                          done->store(true);
                        }),
                        done});
  }
  void stop() {
    std::vector<Job> jobs;
    {
      std::lock_guard<std::mutex> lk(mu_);
      jobs.swap(jobs_);
    }
    for (auto& j : jobs) j.thread.join();
  }

 private:
  struct Job {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::mutex mu_;
  std::vector<Job> jobs_;
};

}  // namespace device
}  // namespace fastcomm
