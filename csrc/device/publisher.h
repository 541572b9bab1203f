#pragma once
// Completes the Futures of settled device Works off the engine thread: a Future's callbacks run
// there and may wait for another device op, which only the engine thread can finish. A callback
// that blocks holds its own thread; the next Future gets a new one. Each is completed inside
// `around` (Runtime::on_idle_stream: the device and stream its events and callbacks see).
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
  explicit Publisher(Around around) : around_(std::move(around)) {}
  ~Publisher() { stop(); }
  void push(c10::intrusive_ptr<Work> w) {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(std::move(w));
    if (idle_ == 0) threads_.emplace_back([this] { loop(); });
    cv_.notify_one();
  }
  // Publishes what is queued, then joins the threads.
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      if (!queue_.empty()) {
        auto w = std::move(queue_.front());
        queue_.pop_front();
        lk.unlock();
        try {
          around_([&] { w->publish(); });
        } catch (...) {
          // (A callback's own error: the Future is completed by then; nothing here to tell.)
        }
        w.reset();
        lk.lock();
        continue;
      }
      if (stop_) return;
      ++idle_;
      cv_.wait(lk);
      --idle_;
    }
  }
  const Around around_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<Work>> queue_;
  std::vector<std::thread> threads_;
  int idle_ = 0;
  bool stop_ = false;
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
