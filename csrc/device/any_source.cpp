// Receives bound to their channel by the engine thread (device/recv_ports.h,
// device/channel_engine.h): a recv from any source in a group of 3+, and the recvs of its
// (group, tag) posted while it waits.
#include <algorithm>
#include <functional>

#include "common/errors.h"
#include "device/channel_engine.h"

namespace fastcomm {
namespace device {

namespace {

// The pair channels as binding sees them: their agreements' watches and offers.
class PortChannels final : public RecvPorts::Channels {
 public:
  explicit PortChannels(std::function<Channel&(int)> channel) : channel_(std::move(channel)) {}
  void watch(int rank, const Key& k) override { channel_(rank).agree.watch(k); }
  void unwatch(int rank, const Key& k) override { channel_(rank).agree.unwatch(k); }
  bool offered(int rank, const Key& k) override {
    Channel& c = channel_(rank);
    return !c.failed && c.agree.offered(k);
  }
  bool failed(int rank) override { return channel_(rank).failed != nullptr; }

 private:
  std::function<Channel&(int)> channel_;
};

}  // namespace

bool ChannelEngine::bind_receives() {
  if (unbound_.empty()) return false;
  PortChannels chans([this](int peer) -> Channel& { return channel(peer); });
  std::vector<RecvPorts::Bound> bound;
  std::vector<RecvPorts::Failed> failed;
  std::vector<DevOp*> late;
  const auto now = Clock::now();
  {
    std::lock_guard<std::mutex> lk(mu_);  // numbers_ is the posters' too
    for (DevOp* op : unbound_)
      if (now > op->deadline && ports_.remove(chans, numbers_.next_seq(), op)) late.push_back(op);
    ports_.step(chans, numbers_.next_seq(), bound, failed);
    for (DevOp* op : late) numbers_.settled(op->port);
    for (auto& b : bound) numbers_.settled(static_cast<DevOp*>(b.token)->port);
    for (auto& f : failed) numbers_.settled(static_cast<DevOp*>(f.token)->port);
  }
  if (bound.empty() && failed.empty() && late.empty()) return false;
  auto gone = [&](DevOp* op) { unbound_.erase(std::find(unbound_.begin(), unbound_.end(), op)); };
  const std::string me = "fastcomm: rank " + std::to_string(rank_);
  for (DevOp* op : late) {
    gone(op);
    fail_op(op, comm_error_ptr(me + ", group " + op->label + ": recv from any source (tag " +
                               std::to_string(op->port.second) + ") got no message from any member within the group's timeout (" +
                               std::to_string(op->timeout.count()) + " ms)"));
    abandon(op);
  }
  for (auto& f : failed) {
    DevOp* op = static_cast<DevOp*>(f.token);
    gone(op);
    Channel& c = channel(f.rank);
    std::string why;
    try {
      std::rethrow_exception(c.failed);
    } catch (const c10::Error& e) {
      why = e.what_without_backtrace();
    } catch (const std::exception& e) {
      why = e.what();
    }
    fail_op(op, comm_error_ptr(me + ", group " + op->label + ": recv from any source failed: rank " +
                               std::to_string(f.rank) + ", a member that could have sent it, is gone (" + why + ")"));
    abandon(op);
  }
  for (auto& b : bound) {
    DevOp* op = static_cast<DevOp*>(b.token);
    gone(op);
    op->unbound = false;
    op->key = b.key;
    if (op->any_source) {
      for (auto& p : op->parts) p->peer = b.from.rank;
      if (op->batch->one_op) op->batch->work->set_source(b.from.group_rank);
    }
    chain(op);
  }
  return true;
}

}  // namespace device
}  // namespace fastcomm
