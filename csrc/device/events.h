#pragma once
// Events of the device engine, pooled: an op records several (its input, its channels' launches,
// its end), and creating and destroying them per op is most of a small op's host cost on CUDA.
// An event goes back to the pool only when its last holder lets go, so a wait enqueued later
// (Work.wait() long after the op) never sees a newer record of a recycled event.
#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "device/runtime.h"

namespace fastcomm {
namespace device {

class EventPool;

struct EventRef {
  EventRef(std::shared_ptr<EventPool> p, Event e) : pool(std::move(p)), ev(e) {}
  ~EventRef();
  EventRef(const EventRef&) = delete;
  EventRef& operator=(const EventRef&) = delete;
  std::shared_ptr<EventPool> pool;
  Event ev;
  uint64_t seq = 0;  // record order (EventPool::record): the later of two on one stream covers both
};
using EventPtr = std::shared_ptr<EventRef>;

// Thread-safe: refs die on whichever thread drops the last Work or op holding them.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  explicit EventPool(Runtime& rt) : rt_(rt) {}
  ~EventPool() {
    for (Event e : free_) {
      try {
        rt_.destroy_event(e);
      } catch (...) {
      }
    }
  }
  EventPtr get() {
    Event e = nullptr;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!free_.empty()) {
        e = free_.back();
        free_.pop_back();
      }
    }
    if (e == nullptr) {
      e = rt_.new_event();
      std::lock_guard<std::mutex> lk(mu_);
      ++created_;
    }
    return std::make_shared<EventRef>(shared_from_this(), e);
  }
  // A fresh event recorded on `s`.
  EventPtr record(Stream s) {
    EventPtr e = get();
    rt_.record(e->ev, s);
    e->seq = seq_.fetch_add(1, std::memory_order_relaxed) + 1;
    return e;
  }
  void put(Event e) {
    std::lock_guard<std::mutex> lk(mu_);
    free_.push_back(e);
  }
  // Events made so far (each comes back to the pool): flat over a long run of ops.
  size_t created() const {
    std::lock_guard<std::mutex> lk(mu_);
    return created_;
  }

 private:
  Runtime& rt_;
  mutable std::mutex mu_;
  std::vector<Event> free_;
  size_t created_ = 0;
  std::atomic<uint64_t> seq_{0};
};

inline EventRef::~EventRef() { pool->put(ev); }

}  // namespace device
}  // namespace fastcomm
