#pragma once
// The Work family: every op of every device completes a fastcomm::Work, a c10d::Work, so
// Python gets torch's own Work type and the torch backend hands out the same objects. The base
// holds the outcome (settled once, by the engine, in the order ops finish) and the Future; a
// host op's wait() drives the engine's progress on the calling thread instead of sleeping on a
// condition variable, which is what makes a blocking op cost microseconds. Device paths derive
// from it (csrc/device/work.h).
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <memory>

namespace fastcomm {

class Work;

// What waits for host Works: the engine (it drives progress meanwhile).
class Waiter {
 public:
  virtual ~Waiter() = default;
  // Returns once `w` is done; throws if `timeout` (0: none) passes first.
  virtual void wait(Work& w, std::chrono::milliseconds timeout) = 0;
  // One non-blocking progress attempt; may be called with the GIL held.
  virtual void poll() = 0;
  // A pending op's Future was asked for: its callbacks run once something drives the op, so
  // the background driver should look soon rather than at its next (maybe slowed) tick.
  virtual void hurry() {}
};

class Work : public c10d::Work {
 public:
  // `parts` ops complete this Work (more than one for a batch).
  Work(std::shared_ptr<Waiter> waiter, int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
       int parts, bool async_op);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override {}
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // The sender of a Work of one recv, as a group rank of the group it was posted on (c10d's
  // contract: torch maps it to a global rank). Known once the recv is matched to a sender (a
  // specific-source one at once); raises before that, and for any other Work.
  int sourceRank() const override;
  // Engine side, before the Work settles; ignored for a Work of several ops (a batch's).
  void set_source(int group_rank) {
    if (parts_ == 1) source_.store(group_rank, std::memory_order_release);
  }

  // A persistent plan's start: its outputs are the plan's list, shared rather than copied
  // (before the Work is posted).
  void share_outputs(std::shared_ptr<const std::vector<at::Tensor>> outputs) { shared_outputs_ = std::move(outputs); }

  // Whether the op is done only once the device has run it (a blocking call then returns at
  // once, the caller's stream ordered after the op, as torch's NCCL backend does).
  virtual bool on_device() const { return false; }

  // Engine side. settle() records that one part finished (or, with `all`, every part) and
  // returns true when that finished the whole Work; the engine calls it under its lock, in the
  // order ops finish, so a group's Works become done in issue order whichever thread drove
  // them. publish() then completes the Future outside the engine lock, because Future
  // callbacks run inline and may call back into fastcomm; the engine publishes in settle order.
  // `has_future` reports whether a Future was asked for by then (one asked for later is
  // completed by getFuture itself).
  bool settle(std::exception_ptr error, bool all, bool* has_future = nullptr);
  void publish();
  bool is_async() const { return async_; }
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Raises the op's error, if any. Called after done().
  void rethrow_if_failed() const;

 protected:
  std::vector<at::Tensor> outputs_;
  std::shared_ptr<const std::vector<at::Tensor>> shared_outputs_;  // used instead when set
  const std::vector<at::Tensor>& outputs() const { return shared_outputs_ ? *shared_outputs_ : outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // created on first getFuture(); mutex_
  bool future_published_ = false;                    // mutex_

 private:
  std::shared_ptr<Waiter> waiter_;
  std::atomic<bool> done_{false};
  int remaining_;  // parts not yet finished; mutex_
  const int parts_;
  std::atomic<int> source_{-1};  // sourceRank(); -1 until known
  const bool async_;
};

}  // namespace fastcomm
