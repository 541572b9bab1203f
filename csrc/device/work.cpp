#include "device/work.h"

#include <ATen/core/jit_type.h>

#include <algorithm>
#include <chrono>

namespace fastcomm {
namespace device {

DeviceWork::DeviceWork(std::shared_ptr<WorkOwner> owner, int rank, c10d::OpType type,
                       std::vector<at::Tensor> outputs, int parts, bool async_op)
    : Work(owner, rank, type, std::move(outputs), parts, async_op), owner_(std::move(owner)) {}

DeviceWork::~DeviceWork() = default;

void DeviceWork::order_after(Stream s) {
  Runtime& rt = owner_->runtime();
  for (const EventPtr& e : ends_) rt.wait(s, e->ev);
}

bool DeviceWork::wait(std::chrono::milliseconds timeout) {
  // Until the peers agreed on the op nothing of it is on the device to order the caller's
  // stream after, so the host waits for that (never for the device itself).
  const auto start = timeout == kNoTimeout ? std::chrono::steady_clock::time_point{} : std::chrono::steady_clock::now();
  owner_->wait_launched(*this, timeout == kNoTimeout ? std::chrono::milliseconds(0) : timeout);
  if (done()) {
    rethrow_if_failed();
    return true;
  }
  order_after(owner_->runtime().current_stream());
  if (timeout == kNoTimeout && !is_async()) owner_->mark_returned(*this);
  if (timeout != kNoTimeout) {
    // One timeout for both waits (at least 1 ms left for the second, which 0 would make unbounded).
    const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    owner_->wait(*this, std::max(std::chrono::milliseconds(1), timeout - spent));
    rethrow_if_failed();
  }
  return true;
}

void DeviceWork::blockCurrentStream() {
  owner_->wait_launched(*this, std::chrono::milliseconds(0));
  if (!done()) order_after(owner_->runtime().current_stream());
}

void DeviceWork::synchronize() {
  owner_->wait(*this, std::chrono::milliseconds(0));
  rethrow_if_failed();
}

c10::intrusive_ptr<c10::ivalue::Future> DeviceWork::getFuture() {
  std::lock_guard<std::mutex> lk(mutex_);
  if (!future_) {
    std::vector<c10::Device> devices;
    for (const auto& t : outputs_)
      if (t.defined() && !t.is_cpu() && std::find(devices.begin(), devices.end(), t.device()) == devices.end())
        devices.push_back(t.device());
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), devices);
    if (completed_) {
      future_published_ = true;
      if (exception_) future_->setError(exception_);
      else future_->markCompleted(c10::IValue(outputs_));
    }
  }
  return future_;
}

}  // namespace device
}  // namespace fastcomm
