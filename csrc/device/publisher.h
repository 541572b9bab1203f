#pragma once
// Completes the Futures of settled device Works off the engine thread: a Future's callbacks run
// there and may wait for another device op, which only the engine thread can finish. A callback
// that blocks holds its own thread; the next Future gets a new one.
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/work.h"

namespace fastcomm {
namespace device {

class Publisher {
 public:
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
        w->publish();
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
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<Work>> queue_;
  std::vector<std::thread> threads_;
  int idle_ = 0;
  bool stop_ = false;
};

}  // namespace device
}  // namespace fastcomm
