#pragma once
// The Work of a device op, with torch's stream semantics as ProcessGroupNCCL has them: wait()
// host-waits only until the op is enqueued, then orders the caller's current stream after it;
// synchronize() host-blocks until it has run; the Future holds device tensors and completes
// when the device has run the op. The device engine (device/engine.cpp) settles it once it has
// seen the op's end on the device, or its failure.
#include <atomic>
#include <memory>
#include <vector>

#include "device/events.h"
#include "device/runtime.h"
#include "engine/work.h"

namespace fastcomm {
namespace device {

class DeviceWork;

// What a DeviceWork asks of its engine.
class WorkOwner : public Waiter {
 public:
  virtual Runtime& runtime() = 0;
  // Returns once `w` is done or its ops are enqueued (DeviceWork::launched).
  virtual void wait_launched(Work& w, std::chrono::milliseconds timeout) = 0;
  // The device engine's error once it is shut down or broken, else null.
  virtual std::exception_ptr broken() const = 0;
  // A blocking call returned with `w` not settled (the backend's: torch's wait() on it): an
  // error it settles with later is raised by its group's next op.
  virtual void mark_returned(DeviceWork& w) = 0;
};

class DeviceWork final : public Work {
 public:
  DeviceWork(std::shared_ptr<WorkOwner> owner, int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
             int parts, bool async_op);
  ~DeviceWork() override;

  // Orders the caller's current stream after the op once it is enqueued (a host wait until its
  // peers agreed on it, never for the device); with a timeout, host-blocks until it has run.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  // torch's Work.block_current_stream(): the caller's stream waits for the op, as after wait(),
  // but an error is left for wait()/exception() (torch's says to check the result later).
  void blockCurrentStream() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  bool on_device() const override { return true; }

  // Engine side, under the engine's lock: the events after the ops' last device work, one per
  // stream they end on, once every op is enqueued; the Work settles when they have run.
  void set_launched(std::vector<EventPtr> ends) {
    ends_ = std::move(ends);
    launched_.store(true, std::memory_order_release);
  }
  bool launched() const { return launched_.load(std::memory_order_acquire); }
  // Under the engine's lock (WorkOwner::mark_returned, settle).
  bool returned = false;
  // Orders `s` after the ops (launched() must be true).
  void order_after(Stream s);

 private:
  std::shared_ptr<WorkOwner> owner_;
  std::vector<EventPtr> ends_;  // set once, before launched_
  std::atomic<bool> launched_{false};
};

}  // namespace device
}  // namespace fastcomm
