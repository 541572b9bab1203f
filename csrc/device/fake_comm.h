#pragma once
// The CPU fake's communicators (fake_runtime.cpp has the whole list of what it keeps): a set of
// abstract-namespace Unix sockets per communicator, a progress thread that bootstraps and
// drains them, sends and receives matched by number, and the operations a stream task runs.
// The communicator's operations are in fake_comm.cpp, its progress thread (bootstrap, then
// the draining of incoming frames) in fake_comm_progress.cpp. Included by the fake's files only.
#include <sys/socket.h>
#include <sys/un.h>

#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "device/fake_streams.h"

namespace fastcomm {
namespace device {
namespace fake {

// ------------------------------------------------------------------------------------------
// Wire

constexpr uint32_t kMagic = 0x6b666366;  // "fcfk"
constexpr uint64_t kMaxErrorBytes = 1 << 16;
enum FrameKind : uint16_t { kHello = 1, kData = 2, kAck = 3, kError = 4 };
// The operation a data frame belongs to: a receive that matches another operation's send is a
// protocol violation, reported as such.
enum OpCode : uint16_t { kP2P = 1, kAllReduce = 2, kBroadcast = 3, kAllGather = 4, kReduceScatter = 5 };

inline const char* op_name(uint16_t code) {
  switch (code) {
    case kP2P: return "send/recv";
    case kAllReduce: return "all_reduce";
    case kBroadcast: return "broadcast";
    case kAllGather: return "all_gather";
    case kReduceScatter: return "reduce_scatter";
    default: return "unknown operation";
  }
}

struct FrameHdr {
  uint32_t magic;
  uint16_t kind;
  uint16_t op;
  uint64_t seq;    // kData/kAck: the send's number on its (communicator, pair); kHello: the rank
  uint64_t bytes;  // payload bytes; kHello: the communicator's size
};
static_assert(sizeof(FrameHdr) == 24, "FrameHdr layout");

// Writes `a` then `b` whole on a non-blocking socket: 0, or the errno that stopped it. Waits for
// room with poll; `stop` (abort) ends such waits (abort also shuts the socket, which ends them
// anyway).
int write_full(int fd, const void* a, size_t na, const void* b, size_t nb, const std::atomic<bool>& stop);

void close_fd(int& fd);

// ------------------------------------------------------------------------------------------
// Communicators

struct Msg {
  uint16_t op = 0;
  uint64_t bytes = 0;
  std::unique_ptr<uint8_t[]> data;
};

struct Peer {
  // Under CommImpl::mu.
  int fd = -1;      // the connection (this rank's own slot: none, it is always up)
  bool up = false;  // connected and identified
  std::unordered_map<uint64_t, Msg> inbox;  // data frames not taken yet, by send number
  std::unordered_set<uint64_t> acks;        // acks of this rank's sends not waited for yet
  std::string gone;  // set: its connection closed; an operation that needs it fails then
  uint64_t next_send = 0, next_recv = 0;    // numbers of the next send / receive issued
  // One writer at a time on fd.
  std::mutex wmu;
  // The progress thread's own.
  bool dead = false;
  FrameHdr hdr{};
  size_t hdr_got = 0;
  Msg cur;
  size_t cur_got = 0;
};

struct SendPart {
  int peer;
  const void* buf;
  size_t bytes;
  uint64_t seq;
};
struct RecvPart {
  int peer;
  void* dst;  // null: keep the message (op.recvs[i].msg) for the fold
  size_t bytes;
  uint64_t seq;
  Msg msg;
};

class CommImpl {
 public:
  CommImpl(const UniqueId& id, int nranks, int rank);
  ~CommImpl();

  int nranks() const { return nranks_; }
  int rank() const { return rank_; }
  const std::string& name() const { return name_; }

  // The listener and the progress thread; throws (naming comm_init) where they cannot be made.
  void start();

  State state(std::string* why);

  // A launch is still being enqueued by its thread (ncclInProgress): the communicator takes no call.
  bool busy() const { return launches_.load() > 0; }
  void begin_launch() { ++launches_; }
  void end_launch() { --launches_; }

  // Ends the communicator's work: what waits on it completes without moving data. Any thread.
  void abort();

  // CUDA graphs holding work of this communicator (NCCL's persistent references): counted while
  // such a graph lives; NCCL's abort and destroy block until none is left.
  void add_graph_ref();
  void drop_graph_ref();
  void wait_graph_refs();
  int64_t graph_refs();

  bool aborted();

  // abort() and the progress thread joined; the sockets close with the last reference (work
  // still queued on a stream holds one).
  void shutdown();

  // Issue-order numbers for a new operation's sends / receives with `peer`.
  uint64_t take_send_number(int peer) { return peers_[peer]->next_send++; }
  uint64_t take_recv_number(int peer) { return peers_[peer]->next_recv++; }
  std::mutex& mu() { return mu_; }

  // ---- the parts of an operation, run by its stream task. Each returns false where the
  // communicator was aborted: the operation then stops without moving (more) data.

  bool post_send(uint16_t code, const SendPart& s);
  bool take_recv(uint16_t code, RecvPart& r);
  bool wait_ack(const SendPart& s);

 private:
  std::mutex refs_mu_;
  std::condition_variable refs_cv_;
  int64_t graph_refs_ = 0;

  // Waits (not spinning) until pred() or abort; true for pred().
  template <typename Pred>
  bool hold(std::unique_lock<std::mutex>& lk, Pred pred) {
    cv_.wait(lk, [&] { return aborted_ || pred(); });
    return !aborted_;
  }

  // A failure inside a task: reported, and the task stays stuck until abort (as NCCL's kernels
  // do). Always false.
  bool stuck(const std::string& why);

  // Under mu_. The first failure is the one reported.
  void set_failed(const std::string& why);

  void fail(const std::string& why);
  int write_to(Peer& p, int fd, const FrameHdr& h, const void* payload);
  void wake();
  socklen_t address(int r, sockaddr_un* a) const;

  // ---- the progress thread: bootstrap, then draining of incoming frames.

  struct Accepted;

  // The connection with `r` is made (by this thread).
  void set_up(int r, int fd);
  bool all_up();

  // One attempt to connect to the higher rank `r`: true once connected (and hello sent).
  bool try_connect(int r);

  // Reads a connecting rank's hello: false when the connection is done with (identified, or
  // dropped).
  bool read_hello(Accepted& c);

  // A whole frame from `r` has arrived.
  void deliver(int r, Peer& p);

  // Drains what `r` sent; false once the connection is lost (reported).
  bool read_frames(int r);

  void progress();

  const int nranks_;
  const int rank_;
  std::string name_;  // hex of the id's first 16 bytes
  std::vector<std::unique_ptr<Peer>> peers_;
  std::mutex mu_;
  std::condition_variable cv_;
  State state_ = State::kPending;
  std::string why_;
  std::atomic<bool> aborted_{false};
  std::atomic<int64_t> launches_{0};  // non-blocking launches whose thread has not ended
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  std::thread progress_;
};

// ------------------------------------------------------------------------------------------
// Operations: a communicator's sends and receives of one call, run by a stream task.

struct Op {
  std::shared_ptr<CommImpl> comm;
  uint16_t code = kP2P;
  std::vector<SendPart> sends;
  std::vector<RecvPart> recvs;
  std::function<void(Op&)> before_recvs;  // once the sends are out (all_gather's own block)
  std::function<void(Op&)> after_recvs;   // once every receive has its data (the folds)
  bool dead = false;                      // aborted: no more data moves
};

// One task's operations, together (a group's on one stream, or a single call's): all sends
// out, then every receive satisfied (and acked), then every send's ack awaited. So a send and a
// receive with the same peer in one group do not wait on each other.
void run_ops(std::vector<Op>& ops);

}  // namespace fake
}  // namespace device
}  // namespace fastcomm
