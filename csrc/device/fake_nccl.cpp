// The fake runtime's NCCL calls (device/fake_runtime_impl.h): ids, communicators' init, state,
// abort and destroy, groups, sends, receives and collectives made of them, and their launch
// (NCCL's non-blocking one: a thread per launch, ncclInProgress until it ends).
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>

#include "common/errors.h"
#include "device/fake_runtime_impl.h"

namespace fastcomm {
namespace device {
namespace fake {

namespace {

// A reduction's arguments, checked as NCCL checks them; returns the bytes per rank's block.
// NCCL's reductions take no int16 (ncclDataType_t has none); the fold does.
size_t check_nccl_reduction(const char* call, const void* in, const void* out, int64_t count, c10::ScalarType dtype,
                            RedOp op) {
  if (dtype == c10::kShort) call_error(call, "NCCL has no int16 dtype (ncclInvalidArgument)");
  check_reduction(call, dtype, op);
  if (count < 0) call_error(call, "negative count");
  if (count > 0 && (!in || !out)) call_error(call, "null buffer");
  return static_cast<size_t>(count) * c10::elementSize(dtype);
}

}  // namespace

UniqueId FakeRuntime::new_id() {
  UniqueId id;
  std::random_device rd;
  for (int i = 0; i < 16; i += 4) {
    const uint32_t v = rd();
    std::memcpy(id.bytes.data() + i, &v, 4);
  }
  std::memcpy(id.bytes.data() + 16, &kMagic, 4);
  return id;
}

Comm FakeRuntime::comm_init(const UniqueId& id, int nranks, int rank) {
  if (nranks < 1) call_error("comm_init", "nranks must be positive, got " + std::to_string(nranks));
  if (rank < 0 || rank >= nranks)
    call_error("comm_init", "rank " + std::to_string(rank) + " out of range for " + std::to_string(nranks) + " ranks");
  uint32_t magic;
  std::memcpy(&magic, id.bytes.data() + 16, 4);
  if (magic != kMagic) call_error("comm_init", "the id was not made by the fake runtime's new_id()");
  auto c = std::make_shared<CommImpl>(id, nranks, rank);
  c->start();
  std::lock_guard<std::mutex> lk(mu_);
  comms_[c.get()] = c;
  return c.get();
}

void FakeRuntime::comm_abort(Comm c) {
  auto comm = comm_of(c, "comm_abort");
  std::shared_ptr<Marker> hold;
  {
    std::lock_guard<std::mutex> lk(mu_);
    hold = abort_hold_;
  }
  if (hold) hold->wait();  // a slow, blocking abort (debug "abort_hold")
  comm->abort();
  // NCCL's abort returns only once no CUDA graph holds work of the communicator (its kernels
  // return at once: the abort flag is set first).
  comm->wait_graph_refs();
}

void FakeRuntime::comm_destroy(Comm c) {
  std::shared_ptr<CommImpl> comm;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = comms_.find(c);
    if (it == comms_.end()) call_error("comm_destroy", "unknown communicator");
    comm = std::move(it->second);
    comms_.erase(it);
  }
  comm->wait_graph_refs();  // as NCCL's finalize and destroy do (see comm_abort)
  comm->shutdown();
}

void FakeRuntime::group_start() {
  std::lock_guard<std::mutex> lk(mu_);
  ++groups_[std::this_thread::get_id()].depth;
}

void FakeRuntime::group_end() {
  std::vector<std::pair<std::shared_ptr<StreamCore>, std::vector<Op>>> work;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = groups_.find(std::this_thread::get_id());
    if (it == groups_.end() || it->second.depth == 0) call_error("group_end", "no group_start() before it");
    if (--it->second.depth > 0) return;
    work = std::move(it->second.work);
    groups_.erase(it);
  }
  // The host stream's share runs inline: last, so the other streams already have theirs.
  std::stable_partition(work.begin(), work.end(), [](const auto& w) { return !w.first->host; });
  for (auto& w : work) launch(*w.first, std::move(w.second));
}

void FakeRuntime::send(const void* buf, size_t bytes, int peer, Comm c, Stream s) {
  auto comm = usable(c, "send");
  auto st = stream_of(s, "send");
  check_peer("send", *comm, peer, "peer");
  if (bytes && !buf) call_error("send", "null buffer");
  Op op;
  op.comm = comm;
  op.sends.push_back({peer, buf, bytes, 0});
  submit(std::move(op), st);
}

void FakeRuntime::recv(void* buf, size_t bytes, int peer, Comm c, Stream s) {
  auto comm = usable(c, "recv");
  auto st = stream_of(s, "recv");
  check_peer("recv", *comm, peer, "peer");
  if (bytes && !buf) call_error("recv", "null buffer");
  Op op;
  op.comm = comm;
  op.recvs.push_back({peer, buf, bytes, 0, {}});
  submit(std::move(op), st);
}

void FakeRuntime::all_reduce(const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp redop, Comm c,
                Stream s) {
  auto comm = usable(c, "all_reduce");
  auto st = stream_of(s, "all_reduce");
  const size_t bytes = check_nccl_reduction("all_reduce", in, out, count, dtype, redop);
  Op op;
  op.comm = comm;
  op.code = kAllReduce;
  exchange_all(*comm, op, [&](int) { return in; }, bytes);
  const int n = comm->nranks(), me = comm->rank();
  op.after_recvs = [=](Op& o) {
    std::vector<const void*> parts(n);
    for (int i = 0, k = 0; i < n; ++i) parts[i] = i == me ? in : o.recvs[k++].msg.data.get();
    quarantine().check(out, bytes);
    fold_parts(out, std::move(parts), count, dtype, redop);
  };
  submit(std::move(op), st);
}

void FakeRuntime::broadcast(void* buf, size_t bytes, int root, Comm c, Stream s) {
  auto comm = usable(c, "broadcast");
  auto st = stream_of(s, "broadcast");
  check_peer("broadcast", *comm, root, "root");
  if (bytes && !buf) call_error("broadcast", "null buffer");
  Op op;
  op.comm = comm;
  op.code = kBroadcast;
  if (comm->rank() == root) {
    for (int p = 0; p < comm->nranks(); ++p)
      if (p != root) op.sends.push_back({p, buf, bytes, 0});
  } else {
    op.recvs.push_back({root, buf, bytes, 0, {}});
  }
  submit(std::move(op), st);
}

void FakeRuntime::all_gather(const void* in, void* out, size_t bytes, Comm c, Stream s) {
  auto comm = usable(c, "all_gather");
  auto st = stream_of(s, "all_gather");
  if (bytes && (!in || !out)) call_error("all_gather", "null buffer");
  const int me = comm->rank();
  auto* o = static_cast<uint8_t*>(out);
  Op op;
  op.comm = comm;
  op.code = kAllGather;
  exchange_all(*comm, op, [&](int) { return in; }, bytes);
  int k = 0;
  for (int p = 0; p < comm->nranks(); ++p)
    if (p != me) op.recvs[k++].dst = o + static_cast<size_t>(p) * bytes;
  op.before_recvs = [=](Op&) {
    if (bytes) std::memmove(o + static_cast<size_t>(me) * bytes, in, bytes);
  };
  submit(std::move(op), st);
}

void FakeRuntime::reduce_scatter(const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp redop, Comm c,
                    Stream s) {
  auto comm = usable(c, "reduce_scatter");
  auto st = stream_of(s, "reduce_scatter");
  const size_t bytes = check_nccl_reduction("reduce_scatter", in, out, count, dtype, redop);
  const auto* blocks = static_cast<const uint8_t*>(in);
  Op op;
  op.comm = comm;
  op.code = kReduceScatter;
  exchange_all(*comm, op, [&](int p) { return blocks + static_cast<size_t>(p) * bytes; }, bytes);
  const int n = comm->nranks(), me = comm->rank();
  op.after_recvs = [=](Op& o) {
    std::vector<const void*> parts(n);
    for (int i = 0, k = 0; i < n; ++i)
      parts[i] = i == me ? blocks + static_cast<size_t>(me) * bytes : o.recvs[k++].msg.data.get();
    fold_parts(out, std::move(parts), count, dtype, redop);
  };
  submit(std::move(op), st);
}

std::shared_ptr<CommImpl> FakeRuntime::comm_of(Comm c, const char* call) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = comms_.find(c);
  if (it == comms_.end()) call_error(call, "unknown communicator");
  return it->second;
}

std::shared_ptr<CommImpl> FakeRuntime::usable(Comm c, const char* call) {
  auto comm = comm_of(c, call);
  if (comm->busy())
    call_error(call, "the communicator is still enqueueing its last launch (ncclInProgress): wait until "
                     "comm_state() is no longer kPending");
  return comm;
}

void FakeRuntime::check_peer(const char* call, const CommImpl& c, int peer, const char* what) {
  if (peer < 0 || peer >= c.nranks())
    call_error(call, std::string(what) + " " + std::to_string(peer) + " out of range for a communicator of " +
                         std::to_string(c.nranks()) + " ranks");
}

template <typename Src>
void FakeRuntime::exchange_all(CommImpl& c, Op& op, Src src, size_t bytes) {
  for (int p = 0; p < c.nranks(); ++p) {
    if (p == c.rank()) continue;
    op.sends.push_back({p, src(p), bytes, 0});
    op.recvs.push_back({p, nullptr, bytes, 0, {}});
  }
}

void FakeRuntime::number(Op& op) {
  std::lock_guard<std::mutex> lk(op.comm->mu());
  for (auto& s : op.sends) s.seq = op.comm->take_send_number(s.peer);
  for (auto& r : op.recvs) r.seq = op.comm->take_recv_number(r.peer);
}

Op FakeRuntime::replica(const Op& t) {
  Op op;
  op.comm = t.comm;
  op.code = t.code;
  op.sends = t.sends;
  for (const auto& r : t.recvs) op.recvs.push_back({r.peer, r.dst, r.bytes, 0, {}});
  op.before_recvs = t.before_recvs;
  op.after_recvs = t.after_recvs;
  number(op);
  return op;
}

void FakeRuntime::submit(Op op, const std::shared_ptr<StreamCore>& st) {
  if (capture().active.load() == 0 || !capturing(st.get())) number(op);
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = groups_.find(std::this_thread::get_id());
    if (it != groups_.end() && it->second.depth > 0) {
      auto& work = it->second.work;
      auto w = std::find_if(work.begin(), work.end(), [&](const auto& x) { return x.first == st; });
      if (w == work.end()) {
        work.emplace_back(st, std::vector<Op>{});
        w = std::prev(work.end());
      }
      w->second.push_back(std::move(op));
      return;
    }
  }
  std::vector<Op> ops;
  ops.push_back(std::move(op));
  launch(*st, std::move(ops));
}

void FakeRuntime::launch(StreamCore& st, std::vector<Op> ops) {
  // NCCL's non-blocking launch: ncclGroupEnd starts a thread that enqueues the group and
  // returns ncclInProgress; the communicators take no call until that thread ends. The work
  // itself goes on the stream here, so events recorded after it cover it (the real runtime
  // defers those records until NCCL's thread is done). A blocking-mode pair communicator
  // enqueues on the calling thread.
  std::vector<std::shared_ptr<CommImpl>> threaded;
  for (auto& op : ops)
    if (!launches_inline(*op.comm) && std::find(threaded.begin(), threaded.end(), op.comm) == threaded.end())
      threaded.push_back(op.comm);
  if (!threaded.empty() && enqueue_us_.load() > 0) {  // 0: usable at once (unit tests)
    for (auto& c : threaded) c->begin_launch();
    ++launch_threads_;
    const int64_t us = enqueue_us_.load();
    std::thread([threaded, us] {
      if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
      for (auto& c : threaded) c->end_launch();
    }).detach();
  }
  auto shared = std::make_shared<std::vector<Op>>(std::move(ops));
  // A kernel, eager or a graph's at each replay: resident (debug "resident_limit") before it
  // moves anything.
  auto res = residency_;
  auto kernel = [](Residency& r, std::vector<Op>& run) {
    const ResidentSlot slot(r, r.enter([&] {
      for (auto& op : run)
        if (op.comm->aborted()) return true;
      return false;
    }));
    run_ops(run);
  };
  std::function<void()> replay = [shared, res, kernel] {
    std::vector<Op> now;
    for (const auto& t : *shared) now.push_back(replica(t));
    kernel(*res, now);
  };
  if (capture_task(&st, replay)) {
    ++captured_launches_;
    // The graph holds a reference on each communicator it captured work of (NCCL's persistent
    // references), dropped when the graph is destroyed.
    std::vector<std::shared_ptr<CommImpl>> seen;
    for (const auto& op : *shared) {
      if (std::find(seen.begin(), seen.end(), op.comm) != seen.end()) continue;
      seen.push_back(op.comm);
      op.comm->add_graph_ref();
      std::shared_ptr<CommImpl> c = op.comm;
      capture_hold(&st, std::shared_ptr<void>(nullptr, [c](void*) { c->drop_graph_ref(); }));
    }
    return;
  }
  if (st.host) {
    run_on(st, [shared] { run_ops(*shared); });
    return;
  }
  run_on(st, [shared, res, kernel] { kernel(*res, *shared); });
}

}  // namespace fake
}  // namespace device
}  // namespace fastcomm
