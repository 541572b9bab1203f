#include "engine/work.h"

#include <ATen/core/jit_type.h>

namespace fastcomm {

Work::Work(std::shared_ptr<Waiter> waiter, int rank, c10d::OpType type,
           std::vector<at::Tensor> outputs, int parts, bool async_op)
    : c10d::Work(rank, type),
      outputs_(std::move(outputs)),
      waiter_(std::move(waiter)),
      remaining_(parts),
      parts_(parts),
      async_(async_op) {}

int Work::sourceRank() const {
  const int s = source_.load(std::memory_order_acquire);
  TORCH_CHECK(s >= 0, "fastcomm: rank ", rank_, ": source rank requested of a Work that is ",
              (parts_ == 1 && (opType_ == c10d::OpType::RECV || opType_ == c10d::OpType::RECVANYSOURCE)
                   ? "a recv not matched to a sender yet (wait for it first)"
                   : "not a single recv"));
  return s;
}

bool Work::isCompleted() {
  if (!done()) waiter_->poll();
  return done();
}

bool Work::isSuccess() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr Work::exception() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return exception_;
}

std::vector<at::Tensor> Work::result() { return outputs(); }

void Work::rethrow_if_failed() const {
  // The outcome is written before done_'s release store and never after, so once done() it is
  // read without the lock (a lock per blocking op otherwise).
  const std::exception_ptr e = done() ? exception_ : exception();
  if (e) std::rethrow_exception(e);
}

bool Work::wait(std::chrono::milliseconds timeout) {
  waiter_->wait(*this, timeout);
  rethrow_if_failed();
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> Work::getFuture() {
  if (!done()) waiter_->hurry();
  std::lock_guard<std::mutex> lk(mutex_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    if (completed_) {
      future_published_ = true;
      if (exception_) future_->setError(exception_);
      else future_->markCompleted(c10::IValue(outputs()));
    }
  }
  return future_;
}

bool Work::settle(std::exception_ptr error, bool all, bool* has_future) {
  std::lock_guard<std::mutex> lk(mutex_);
  if (completed_) return false;
  if (error && !exception_) exception_ = error;  // a batch reports its first failed op
  remaining_ = all ? 0 : remaining_ - 1;
  if (remaining_ > 0) return false;
  completed_ = true;
  done_.store(true, std::memory_order_release);
  if (has_future) *has_future = future_ != nullptr;
  return true;
}

void Work::publish() {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    if (!completed_ || future_published_ || !future_) return;
    future_published_ = true;
    fut = future_;
    error = exception_;
  }
  if (error) fut->setError(error);
  else fut->markCompleted(c10::IValue(outputs()));
}

}  // namespace fastcomm
