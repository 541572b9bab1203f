#include "transport/nccl/transport.h"

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
void wait_all(c10d::Store& store, const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
              int rank, const char* what) {
  try {
    store.wait(keys, timeout);
  } catch (const std::exception& e) {
    std::string missing;
    for (const auto& k : keys) {
      bool present = false;
      try {
        present = store.check({k});
      } catch (...) {
      }
      if (!present) missing += (missing.empty() ? "" : ", ") + k.substr(k.rfind('/') + 1);
    }
    throw_comm_error("fastcomm: rank " + std::to_string(rank) + ": " + what + " timed out after " +
                     std::to_string(timeout.count()) + " ms; ranks not there: [" + missing +
                     "]. The NCCL world communicator is made at each rank's first CUDA op, so every "
                     "rank must issue one (or call fastcomm.init_cuda()). (" + e.what() + ")");
  }
}
}  // namespace

WorldComm::WorldComm(c10d::Store& store, int rank, int world, int device,
                     std::chrono::milliseconds timeout)
    : device_(device) {
  ncclUniqueId id;
  if (rank == 0) {
    FASTCOMM_GPU_CHECK(ncclGetUniqueId(&id));
    std::vector<uint8_t> v(sizeof(id));
    std::memcpy(v.data(), &id, sizeof(id));
    store.set("nccl/id", v);
  }
  // Everyone announces itself before anyone enters NCCL's init, which would otherwise block
  // without a limit on a rank that never comes.
  store.set("nccl/ready/" + std::to_string(rank), std::vector<uint8_t>{1});
  std::vector<std::string> keys{"nccl/id"};
  for (int r = 0; r < world; ++r) keys.push_back("nccl/ready/" + std::to_string(r));
  wait_all(store, keys, timeout, rank, "creating the NCCL world communicator");
  auto v = store.get("nccl/id");
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
