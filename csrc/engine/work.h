#pragma once
// fastcomm's Work is a c10d::Work, so Python gets torch's own Work type (wait, is_completed,
// exception, get_future) and the torch.distributed backend can hand the same objects out.
// The engine completes it; wait() drives the engine's progress on the calling thread instead
// of sleeping on a condition variable, which is what makes a blocking op cost microseconds.
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <memory>

namespace fastcomm {

class Engine;

class Work final : public c10d::Work {
 public:
  // `parts` ops complete this Work (more than one for a batch).
  Work(std::shared_ptr<Engine> engine, int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
       int parts, bool async_op);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override {}
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

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

 private:
  std::shared_ptr<Engine> engine_;
  std::vector<at::Tensor> outputs_;
  std::atomic<bool> done_{false};
  int remaining_;  // parts not yet finished; guarded by mutex_
  const bool async_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // created on first getFuture()
  bool future_published_ = false;                   // guarded by mutex_
};

}  // namespace fastcomm
