#include "cuda/nccl.h"

#include <cstring>
#include <vector>

namespace fastcomm {
namespace nccl {

void fail(ncclResult_t r, ncclComm_t comm, const char* expr, const char* file, int line) {
  const char* last = ncclGetLastError(comm);
  throw_comm_error(std::string("fastcomm: NCCL error in ") + expr + " (" + file + ":" +
                   std::to_string(line) + "): " + ncclGetErrorString(r) +
                   (last && *last ? std::string("; ") + last : std::string()));
}

void fail(cudaError_t r, ncclComm_t, const char* expr, const char* file, int line) {
  (void)cudaGetLastError();  // clear a sticky-free error so the next call is not blamed for it
  throw_comm_error(std::string("fastcomm: CUDA error in ") + expr + " (" + file + ":" +
                   std::to_string(line) + "): " + cudaGetErrorName(r) + ": " + cudaGetErrorString(r));
}

namespace {

// The outcome of one rendezvous attempt, decided once for every rank: the last rank to arrive
// proposes "go", a rank whose wait timed out proposes "aborted", and the store's compare-and-set
// keeps whichever came first. So either every rank enters ncclCommInitRank or none does. (With a
// plain barrier a rank arriving just after the others gave up would find their "ready" keys,
// pass, and block inside NCCL's init, which has no timeout, for good.)
std::string decide(c10d::Store& store, const std::string& key, const std::string& proposal) {
  return store.compareSet(key, std::string(), proposal);
}

std::string missing_ranks(c10d::Store& store, const std::string& prefix, int world) {
  std::string missing;
  for (int r = 0; r < world; ++r) {
    bool present = false;
    try {
      present = store.check({prefix + "ready/" + std::to_string(r)});
    } catch (...) {
    }
    if (!present) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  }
  return missing;
}

}  // namespace

WorldComm::WorldComm(c10d::Store& store, int rank, int world, int device,
                     std::chrono::milliseconds timeout)
    : device_(device) {
  // Each attempt rendezvouses under its own epoch: the first whose outcome is undecided. An
  // attempt that failed (a rank never came) leaves its epoch decided, so a later attempt (the
  // next CUDA op), or a rank that comes late, starts afresh instead of reading stale keys.
  int epoch = 0;
  while (store.check({"nccl/" + std::to_string(epoch) + "/state"})) ++epoch;
  const std::string pre = "nccl/" + std::to_string(epoch) + "/";
  const std::string state = pre + "state";

  ncclUniqueId id;
  if (rank == 0) {
    FASTCOMM_GPU_CHECK(ncclGetUniqueId(&id));
    std::vector<uint8_t> v(sizeof(id));
    std::memcpy(v.data(), &id, sizeof(id));
    store.set(pre + "id", v);  // before rank 0 arrives: "go" implies the id is there
  }
  // Everyone announces itself before anyone enters NCCL's init, which would otherwise block
  // without a limit on a rank that never comes.
  store.set(pre + "ready/" + std::to_string(rank), std::vector<uint8_t>{1});
  std::string outcome, why;
  if (store.add(pre + "arrived", 1) == world) {
    outcome = decide(store, state, "go");
  } else {
    try {
      store.wait({state}, timeout);
      outcome = store.get_to_str(state);
    } catch (const std::exception& e) {
      why = e.what();
      outcome = decide(store, state, "aborted");  // may still find "go": then this rank goes too
    }
  }
  if (outcome != "go") {
    const std::string missing = missing_ranks(store, pre, world);
    throw_comm_error("fastcomm: rank " + std::to_string(rank) + ": creating the NCCL world communicator " +
                     (why.empty() ? std::string("failed: this rank came after the others had given up waiting")
                                  : "timed out after " + std::to_string(timeout.count()) + " ms") +
                     (missing.empty() ? std::string() : "; ranks not there: [" + missing + "]") +
                     ". The NCCL world communicator is made at each rank's first CUDA op, so every rank must "
                     "issue one (or call fastcomm.init_cuda()) within the init timeout of the others" +
                     (why.empty() ? std::string() : " (" + why + ")"));
  }
  auto v = store.get(pre + "id");
  TORCH_INTERNAL_ASSERT(v.size() == sizeof(id), "bad NCCL unique id in the store");
  std::memcpy(&id, v.data(), sizeof(id));

  FASTCOMM_GPU_CHECK(cudaSetDevice(device));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  FASTCOMM_GPU_CHECK(ncclCommInitRankConfig(&comm_, world, id, rank, &config));
}

WorldComm::~WorldComm() {
  std::lock_guard<std::mutex> lk(abort_mu_);
  if (comm_ != nullptr && !aborted_) {
    // Destroying waits for the communicator's pending work; at exit, after a fault, that
    // could block, so a process that is going away aborts instead.
    (void)ncclCommAbort(comm_);
  }
  comm_ = nullptr;
}

ncclResult_t WorldComm::async_error() {
  ncclResult_t r = ncclSuccess;
  if (comm_ == nullptr || aborted_) return ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess) return ncclInternalError;
  return r == ncclInProgress ? ncclSuccess : r;
}

void WorldComm::abort() {
  std::lock_guard<std::mutex> lk(abort_mu_);
  if (aborted_ || comm_ == nullptr) return;
  aborted_ = true;
  (void)ncclCommAbort(comm_);
}

}  // namespace nccl
}  // namespace fastcomm
