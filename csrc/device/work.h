#pragma once
// The Work of a device op, with torch's stream semantics as ProcessGroupNCCL has them: wait()
// orders the caller's current stream after the op, synchronize() host-blocks until it has run,
// and the Future holds device tensors. The device engine (device/engine.cpp) settles it once
// it has seen the op's end on the device, or its failure.
#include <atomic>
#include <memory>
#include <vector>

#include "device/runtime.h"
#include "engine/work.h"

namespace fastcomm {
namespace device {

// What a DeviceWork asks of its engine.
class WorkOwner : public Waiter {
 public:
  virtual Runtime& runtime() = 0;
  // Returns once `w` is done or its end event is enqueued (see DeviceWork::end).
  virtual void wait_end(Work& w, std::chrono::milliseconds timeout) = 0;
  // The device engine's error once it is shut down or broken, else null.
  virtual std::exception_ptr broken() const = 0;
};

class DeviceWork final : public Work {
 public:
  DeviceWork(std::shared_ptr<WorkOwner> owner, int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
             int parts, bool async_op);
  ~DeviceWork() override;

  // Orders the caller's current stream after the op (once its end is enqueued, which may need
  // a host wait until the op's transfers have run); with a timeout, host-blocks up to it.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  bool on_device() const override { return true; }

  // Engine side: the event recorded after the op's last device work (its fold), once it is
  // enqueued; the Work then settles when it has run. Owned by the Work from then on.
  void set_end(Event e) { end_.store(e, std::memory_order_release); }
  Event end() const { return end_.load(std::memory_order_acquire); }

 private:
  std::shared_ptr<WorkOwner> owner_;
  std::atomic<Event> end_{nullptr};
};

}  // namespace device
}  // namespace fastcomm
