// The fake runtime's test hooks (device/fake_runtime_impl.h): long and held kernels, captures
// driven from a test, late writes, same-host block settings, a blocking abort, the residency
// limit, and how long a launch keeps its communicators busy.
#include <chrono>
#include <cstdio>

#include "device/fake_runtime_impl.h"

namespace fastcomm {
namespace device {
namespace fake {

int64_t FakeRuntime::debug(const std::string& what, int64_t arg) {
  if (what == "work_entries") return work_entries_.load();
  if (what == "idle_stream_calls") return idle_calls_.load();
  if (what == "fail_new_streams") {  // the next `arg` new_stream() calls throw
    failing_streams_.store(arg);
    return 0;
  }
  if (what == "sticky_error") {
    sticky_.store(arg != 0);
    return 0;
  }
  if (what == "callback_calls") return fake::callback_calls().load();
  if (what == "spin") {
    run_on(*caller_, [arg] { std::this_thread::sleep_for(std::chrono::milliseconds(arg)); });
    return 0;
  }
  if (what == "hold") {  // a kernel that runs until "release"
    auto m = std::make_shared<Marker>();
    {
      std::lock_guard<std::mutex> lk(mu_);
      holds_.push_back(m);
    }
    run_on(*caller_, [m] { m->wait(); });
    return 0;
  }
  if (what == "release") {
    std::vector<std::shared_ptr<Marker>> held;
    {
      std::lock_guard<std::mutex> lk(mu_);
      held.swap(holds_);
    }
    for (auto& m : held) m->set();
    return (int64_t)held.size();
  }
  if (what == "begin_capture") {
    start_capture(caller_, arg == 0);
    return 0;
  }
  if (what == "end_capture") {  // 0 where the capture was refused; arg 1 keeps the graph: its id
    std::shared_ptr<FakeGraph> g;
    try {
      g = finish_capture(caller_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fastcomm fake runtime: %s\n", e.what());
      return 0;
    }
    if (arg != 1) return 1;
    std::lock_guard<std::mutex> lk(mu_);
    user_graphs_.push_back(std::move(g));
    return (int64_t)user_graphs_.size();
  }
  if (what == "graph_launch" || what == "graph_destroy") {  // a graph kept by end_capture, by id
    std::shared_ptr<FakeGraph> g;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (arg < 1 || arg > (int64_t)user_graphs_.size() || !user_graphs_[(size_t)arg - 1])
        call_error(what.c_str(), "no graph " + std::to_string(arg));
      g = user_graphs_[(size_t)arg - 1];
      if (what == "graph_destroy") user_graphs_[(size_t)arg - 1] = nullptr;  // a queued launch keeps it
    }
    if (what == "graph_launch") {
      refuse_launch_under_capture(caller_.get());
      run_on(*caller_, [g] { g->run(); });
    }
    return 0;
  }
  if (what == "late_writes") return quarantine().late_writes.load();
  if (what == "lane_stagger") {
    lane_stagger_ms().store(arg);
    return 0;
  }
  if (what == "ipc_blocks") return fake::ipc_blocks();
  if (what == "ipc_freed_while_mapped") return fake::freed_while_mapped();
  if (what == "ipc_open_hold") {  // the next ipc_opens wait, their data mapped, until released (arg 0)
    fake::set_open_hold(arg != 0);
    return 0;
  }
  if (what == "ipc_early_waits") return fake::early_waits();
  if (what == "ipc_graphs") {  // plans captured from now on
    ipc_graphs_ = arg != 0;
    return 0;
  }
  if (what == "fake_device" || what == "peer_access") {  // links made from now on (fake_ipc.h)
    if (what == "fake_device") fake::set_device((int)arg);
    else fake::set_peer_access(arg != 0);
    return 0;
  }
  if (what == "abort_hold") {  // comm_abort blocks until "abort_release"
    std::lock_guard<std::mutex> lk(mu_);
    abort_hold_ = std::make_shared<Marker>();
    return 0;
  }
  if (what == "abort_release") {
    std::shared_ptr<Marker> hold;
    {
      std::lock_guard<std::mutex> lk(mu_);
      hold.swap(abort_hold_);
    }
    if (hold) hold->set();
    return 0;
  }
  if (what == "resident_limit" || what == "resident" || what == "resident_waits") {
    std::lock_guard<std::mutex> lk(residency_->mu);
    if (what == "resident") return residency_->resident;
    if (what == "resident_waits") return residency_->waits;
    residency_->limit = arg;
    residency_->cv.notify_all();
    return 0;
  }
  if (what == "launch_threads") return launch_threads_.load();
  if (what == "captured_launches") return captured_launches_.load();
  if (what == "enqueue_us") {
    enqueue_us_ = arg;
    return 0;
  }
  return Runtime::debug(what, arg);
}

namespace {
std::mutex process_capture_mu;
std::shared_ptr<StreamCore> process_capture_stream;  // under process_capture_mu
}  // namespace

}  // namespace fake

int64_t fake_process_capture(bool begin, bool global) {
  using namespace fake;
  std::lock_guard<std::mutex> lk(process_capture_mu);
  if (begin) {
    if (process_capture_stream) call_error("process_capture", "one is under way already");
    auto st = std::make_shared<StreamCore>(false);
    start_capture(st, global);
    process_capture_stream = std::move(st);
    return 1;
  }
  if (!process_capture_stream) call_error("process_capture", "none is under way");
  auto st = std::move(process_capture_stream);
  try {
    finish_capture(st);
  } catch (const std::exception&) {
    return 0;  // invalidated
  }
  return 1;
}

}  // namespace device
}  // namespace fastcomm
