// A plan graph's IPC links at their end (device/graph.h): a failed plan's drain, the links'
// retirement, and what user graphs that recorded the plan hold of them.
#include <algorithm>
#include <thread>

#include "device/graph.h"

namespace fastcomm {
namespace device {

// What a user's graph that recorded the plan holds: the plan's watch (its host calls count the
// runs), its memory where no communicator's aborter holds it, and its links. It may run after
// the plan is gone (the rule is that it must not, docs/design.md): its links then stay
// mapped, and a run of it found starting is treated as a run of a failed plan (the peer is
// told its data is garbage; the waits are released until it has ended), so it ends instead of
// hanging. Dropped by the last holder,
// maybe on a CUDA thread (a user object's destructor, which may make no CUDA call nor block):
// a thread of its own hands everything to `retire`, keeping the engine alive meanwhile.
struct PlanGraph::LinkKeep {
  using Retire = std::function<void(std::vector<std::unique_ptr<IpcLink>>, std::shared_ptr<void>)>;
  Retire retire;
  std::shared_ptr<void> owner;  // the engine, and so the runtime the links need
  std::shared_ptr<Watch> watch;
  std::vector<std::unique_ptr<IpcLink>> links;
  std::shared_ptr<void> rest;
  // The drain of late runs; it outlives this record (see ~LinkKeep), so it shares only the
  // watch, its stop flag and the links, which the hand-off keeps until it has joined it.
  std::thread late;
  std::shared_ptr<std::atomic<bool>> stop = std::make_shared<std::atomic<bool>>(false);

  void adopt(std::vector<std::unique_ptr<IpcLink>> ls, std::shared_ptr<void> r, bool failed) {
    links = std::move(ls);
    rest = std::move(r);
    std::vector<IpcLink*> raw;
    for (auto& l : links) {
      if (!failed) l->end_fixed(/*failed=*/false);
      raw.push_back(l.get());
    }
    if (raw.empty()) return;  // a plan without links: only its memory and watch are held
    try {
      late = std::thread([w = watch, st = stop, raw, failed] { drain_late(*w, *st, raw, failed); });
    } catch (...) {
      // No thread to be had: a late run of a user's graph would wait for good, but nothing else.
    }
  }

  // While a run of a user's graph is in flight (the host nodes' counts): the first one taints
  // the links (the peer is told), and their waits are released every 200 us until it ends.
  static void drain_late(Watch& watch, std::atomic<bool>& stop, const std::vector<IpcLink*>& raw, bool failed) {
    bool tainted = failed;
    for (;;) {
      {
        std::unique_lock<std::mutex> wl(watch.mu);
        watch.cv.wait_for(wl, std::chrono::milliseconds(50), [&] { return stop.load() || watch.started > watch.ended; });
        if (stop) return;
        if (watch.started <= watch.ended) continue;
      }
      for (IpcLink* l : raw) {
        if (!tainted) l->end_fixed(/*failed=*/true);
        l->release_fixed();
      }
      tainted = true;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // Maybe on CUDA's thread (a user object's destructor): no CUDA call and no wait here. The
  // drain is stopped and joined, and the links and memory retired, on a thread of its own.
  ~LinkKeep() {
    if (watch) {
      {
        std::lock_guard<std::mutex> wl(watch->mu);
        *stop = true;
      }
      watch->cv.notify_all();
    }
    if (!late.joinable() && ((links.empty() && !rest) || !retire)) return;
    struct Handoff {
      Retire retire;
      std::vector<std::unique_ptr<IpcLink>> links;
      std::shared_ptr<void> rest, owner;
      std::thread late;
    };
    auto h = std::make_shared<Handoff>(
        Handoff{std::move(retire), std::move(links), std::move(rest), std::move(owner), std::move(late)});
    try {
      std::thread([h] {
        if (h->late.joinable()) h->late.join();
        if (!h->retire || (h->links.empty() && !h->rest)) return;
        try {
          h->retire(std::move(h->links), std::move(h->rest));
        } catch (...) {
        }
      }).detach();
    } catch (...) {
      new std::shared_ptr<Handoff>(h);  // no thread to be had: kept for good (freeing here may call CUDA)
    }
  }
};

void PlanGraph::keep_with(Stream caller) {
  if (!keep_) {
    keep_ = std::make_shared<LinkKeep>();
    keep_->retire = links_.retire;
    keep_->owner = owner_;
    keep_->watch = watch_;
  }
  rt_.capture_keep(caller, keep_);
}

std::string PlanGraph::garbage_locked() {
  for (auto& q : pairs_)
    if (q.link && q.link->peer_garbage())
      return "rank " + std::to_string(q.peer) + "'s side of the plan failed with runs in flight";
  return "";
}

void PlanGraph::start_drain() {
  if (drain_.joinable()) return;
  std::vector<IpcLink*> links;
  for (auto& q : pairs_)
    if (q.link) links.push_back(q.link.get());
  if (links.empty()) return;
  // The links live until release() has joined this thread.
  drain_ = std::thread([this, links] {
    while (!drain_stop_.load()) {
      for (IpcLink* l : links) l->release_fixed();
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
}

void PlanGraph::end_links() {
  drain_stop_ = true;
  if (drain_.joinable()) drain_.join();
  std::vector<std::unique_ptr<IpcLink>> links;
  for (auto& q : pairs_) {
    if (!q.link) continue;
    links.push_back(std::move(q.link));
    q.stream = nullptr;  // the links stream goes on its own
  }
  if (keep_) {
    // Held by user graphs: ended and unmapped when the last of them goes. The plan's memory goes
    // with them unless a communicator's aborter holds it (abort_comms).
    const bool comms = std::any_of(pairs_.begin(), pairs_.end(), [](const Pair& q) { return q.comm != nullptr; });
    std::shared_ptr<void> rest;
    if (!comms) rest = std::make_shared<std::vector<std::unique_ptr<DevOp>>>(std::move(ops_));
    keep_->adopt(std::move(links), std::move(rest), broken_ != nullptr);
    keep_.reset();
    return;
  }
  if (links.empty()) return;
  for (auto& l : links) {
    try {
      l->end_fixed(/*failed=*/false);  // a failed one told the peer before
      l->close_peer();
    } catch (...) {
    }
  }
  if (links_.retire) {
    try {
      links_.retire(std::move(links), nullptr);
    } catch (...) {
    }
  }
}

}  // namespace device
}  // namespace fastcomm
