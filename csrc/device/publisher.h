#pragma once
// Completes the Futures of settled device Works off the engine thread: a Future's callbacks run
// there and may wait for another device op, which only the engine thread can finish. A callback
// that blocks holds its own thread; the next Future gets a new one. Each is completed inside
// `around` (Runtime::on_idle_stream: the device and stream its events and callbacks see).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <deque>
#include <functional>
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
  void push(c10::intrusive_ptr<Work> w) {
    std::unique_lock<std::mutex> lk(st_->mu);
    if (st_->stop) {  // (after teardown nothing pushes; a late one is still completed)
      lk.unlock();
      publish(*st_, std::move(w));
      return;
    }
    st_->queue.push_back(std::move(w));
    if (st_->idle == 0) {
      ++st_->running;
      threads_.emplace_back([st = st_] { loop(st); });
    }
    st_->cv.notify_one();
  }
  // Joins the idle threads and publishes what is still queued on the caller's thread (by then
  // every op is settled, so no callback waits long). A thread inside a publish is detached, not
  // joined: its callback may itself be waiting for the caller (fastcomm.shutdown() from a
  // callback, or the engine's last reference dropped there). It touches only the shared state
  // afterwards, and takes nothing more from the queue.
  void stop() {
    std::unique_lock<std::mutex> lk(st_->mu);
    st_->stop = true;
    st_->cv.notify_all();
    for (;;) {
      st_->cv.wait(lk, [&] { return st_->running == st_->busy; });
      if (st_->queue.empty()) break;
      auto w = std::move(st_->queue.front());
      st_->queue.pop_front();
      lk.unlock();
      publish(*st_, std::move(w));
      lk.lock();
    }
    std::vector<std::thread> threads;
    threads.swap(threads_);
    lk.unlock();
    for (auto& t : threads) {
      if (t.get_id() == std::this_thread::get_id() || busy_ids_contain(t.get_id())) t.detach();
      else t.join();
    }
  }

 private:
  struct State {
    explicit State(Around a) : around(std::move(a)) {}
    const Around around;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<c10::intrusive_ptr<Work>> queue;
    std::vector<std::thread::id> busy_ids;  // threads inside publish()
    int running = 0;  // threads not yet returned from loop()
    int busy = 0;
    int idle = 0;
    bool stop = false;
  };

  bool busy_ids_contain(std::thread::id id) {
    std::lock_guard<std::mutex> lk(st_->mu);
    for (auto b : st_->busy_ids)
      if (b == id) return true;
    return false;
  }

  // Completes `w`'s Future; its last reference (and so possibly the engine's) is dropped inside.
  static void publish(State& st, c10::intrusive_ptr<Work> w) {
    try {
      st.around([&] {
        auto mine = std::move(w);
        mine->publish();
      });
    } catch (...) {
      // (A callback's own error: the Future is completed by then; nothing here to tell.)
    }
  }

  static void loop(std::shared_ptr<State> st) {
    std::unique_lock<std::mutex> lk(st->mu);
    for (;;) {
      if (st->stop) break;
      if (!st->queue.empty()) {
        auto w = std::move(st->queue.front());
        st->queue.pop_front();
        ++st->busy;
        st->busy_ids.push_back(std::this_thread::get_id());
        lk.unlock();
        publish(*st, std::move(w));
        lk.lock();
        --st->busy;
        st->busy_ids.erase(std::find(st->busy_ids.begin(), st->busy_ids.end(), std::this_thread::get_id()));
        continue;
      }
      ++st->idle;
      st->cv.wait(lk);
      --st->idle;
    }
    --st->running;
    st->cv.notify_all();
  }

  std::shared_ptr<State> st_;
  std::vector<std::thread> threads_;  // the engine's thread(s) only: push and stop
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
