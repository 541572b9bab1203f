// Same-host blocks on CUDA (cuda/ipc.h).
#include "cuda/ipc.h"

#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <c10/cuda/CUDAGuard.h>

#include <cstdio>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <random>
#include <string>

#include "cuda/reduce.h"
#include "cuda/runtime.h"

namespace fastcomm {
namespace cuda {

namespace {

using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using GetErrorName = CUresult (*)(CUresult, const char**);

struct Driver {
  WaitValue32 wait = nullptr;
  WriteValue32 write = nullptr;
  GetErrorName error_name = nullptr;
};

// The driver's entry points, through the runtime (no link to libcuda).
const Driver& driver() {
  static Driver d = [] {
    Driver r;
    cudaDriverEntryPointQueryResult st;
    void* p = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &p, 12000, cudaEnableDefault, &st) == cudaSuccess &&
        st == cudaDriverEntryPointSuccess)
      r.wait = reinterpret_cast<WaitValue32>(p);
    p = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &p, 12000, cudaEnableDefault, &st) == cudaSuccess &&
        st == cudaDriverEntryPointSuccess)
      r.write = reinterpret_cast<WriteValue32>(p);
    p = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuGetErrorName", &p, 12000, cudaEnableDefault, &st) == cudaSuccess &&
        st == cudaDriverEntryPointSuccess)
      r.error_name = reinterpret_cast<GetErrorName>(p);
    (void)cudaGetLastError();
    return r;
  }();
  return d;
}

void check_cu(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  if (driver().error_name == nullptr || driver().error_name(r, &name) != CUDA_SUCCESS || name == nullptr)
    name = "unknown";
  throw_comm_error(std::string("fastcomm: CUDA driver error in ") + what + ": " + name + " (" +
                   std::to_string((int)r) + ")");
}

struct Wire {
  cudaIpcMemHandle_t mem;  // a device block's memory (a host block: unused)
  char name[30];           // the /dev/shm segment: the flags, then a host block's data
  uint8_t host;
  uint8_t pad;
  char uuid[16];           // the owner's device
};
static_assert(sizeof(Wire) <= sizeof(IpcHandle::bytes), "CUDA IPC handle layout");

struct Block {
  void* data = nullptr;
  bool creator = false;
  bool host = false;
  void* flags = nullptr;
  size_t flags_size = 0;  // the mapping (a host block's data included)
  std::string name;
};

size_t flags_size(int nflags) { return (((size_t)nflags * 4) + 4095) & ~size_t(4095); }

void device_uuid(int device, char out[16]) {
  cudaDeviceProp p;
  FASTCOMM_GPU_CHECK(cudaGetDeviceProperties(&p, device));
  std::memcpy(out, p.uuid.bytes, 16);
}

void* map_flags(const char* name, size_t size, bool create) {
  int fd = shm_open(name, create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) throw_comm_error(std::string("fastcomm: shm_open(") + name + "): " + std::strerror(errno));
  if (create && ftruncate(fd, (off_t)size) != 0) {
    close(fd);
    shm_unlink(name);
    throw_comm_error(std::string("fastcomm: ftruncate of ") + name + ": " + std::strerror(errno));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    if (create) shm_unlink(name);
    throw_comm_error(std::string("fastcomm: mmap of ") + name + ": " + std::strerror(errno));
  }
  return p;
}

}  // namespace

bool ipc_supported(int device) {
  const Driver& d = driver();
  if (d.wait == nullptr || d.write == nullptr) return false;
  // The caller's thread may have another device current: the probe, its stream and the kernels
  // it loads are this device's.
  c10::cuda::CUDAGuard g((c10::DeviceIndex)device);
  int same_address = 0;
  if (cudaDeviceGetAttribute(&same_address, cudaDevAttrCanUseHostPointerForRegisteredMem, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (same_address != 1) return false;
  // What the links need, tried once: some platforms (WSL, containers without the IPC namespace)
  // refuse cudaIpcGetMemHandle or registering shared pages, or the stream flag operations, and
  // the channels then stay on NCCL. The small-chunk kernels are loaded here too: under lazy
  // loading their first launch could otherwise wait for the device inside an enqueue, while
  // work on it waits for a peer's next enqueue.
  void* token = nullptr;
  cudaStream_t s = nullptr;
  bool ok = false;
  try {
    IpcHandle h;
    IpcBlock b;
    token = ipc_create(device, 256, 4, &h, &b, /*host=*/false);
    FASTCOMM_GPU_CHECK(preload_kernels());
    FASTCOMM_GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    flag_write(b.flags, 1, s);
    flag_wait(s, b.flags, 1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    cudaError_t q;
    while ((q = cudaStreamQuery(s)) == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    (void)cudaGetLastError();  // (the polls' cudaErrorNotReady is no error of the caller's)
    if (q == cudaErrorNotReady) {  // still waited on: its memory stays, only its name goes
      shm_unlink(static_cast<Block*>(token)->name.c_str());
      token = nullptr;
      throw_comm_error("a stream flag write and wait did not complete within 5 s");
    }
    FASTCOMM_GPU_CHECK(q);
    if (__atomic_load_n(b.flags, __ATOMIC_ACQUIRE) != 1) throw_comm_error("a stream flag write did not land");
    ok = true;
  } catch (const std::exception& e) {
    (void)cudaGetLastError();
    TORCH_WARN("fastcomm: same-host device channels over CUDA IPC are off (device channels use NCCL): ", e.what());
  }
  if (s) FASTCOMM_GPU_WARN(cudaStreamDestroy(s));
  try {
    if (token) ipc_close(device, token);
  } catch (const std::exception& e) {
    if (ok) TORCH_WARN("fastcomm: the IPC probe's block could not be freed: ", e.what());
  }
  return ok;
}

bool ipc_graphs(int device) {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [device] {
    c10::cuda::CUDAGuard g((c10::DeviceIndex)device);
    void* token = nullptr;
    cudaStream_t s = nullptr;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    try {
      IpcHandle h;
      IpcBlock b;
      token = ipc_create(device, 256, 2, &h, &b, /*host=*/false);
      FASTCOMM_GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      FASTCOMM_GPU_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      bool captured = true;
      try {
        flag_wait(s, b.flags, 1);
        flag_write(b.flags + 1, 7, s);
      } catch (const std::exception&) {
        captured = false;  // the capture is invalidated: ended below
      }
      const cudaError_t end = cudaStreamEndCapture(s, &graph);
      if (captured && end == cudaSuccess && graph != nullptr &&
          cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
        __atomic_store_n(b.flags, 1, __ATOMIC_RELEASE);  // the captured wait is met at once
        if (cudaGraphLaunch(exec, s) == cudaSuccess) {
          // Bounded: a device that never sees the host's store would otherwise hang every capture.
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
          cudaError_t q;
          while ((q = cudaStreamQuery(s)) == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline)
            std::this_thread::sleep_for(std::chrono::microseconds(100));
          if (q == cudaSuccess) ok = __atomic_load_n(b.flags + 1, __ATOMIC_ACQUIRE) == 7;
          if (q == cudaErrorNotReady) {  // still waited on: its memory stays, only its name goes
            shm_unlink(static_cast<Block*>(token)->name.c_str());
            token = nullptr;
          }
        }
      }
    } catch (const std::exception&) {
    }
    if (exec) FASTCOMM_GPU_WARN(cudaGraphExecDestroy(exec));
    if (graph) FASTCOMM_GPU_WARN(cudaGraphDestroy(graph));
    if (s) FASTCOMM_GPU_WARN(cudaStreamDestroy(s));
    (void)cudaGetLastError();
    try {
      if (token) ipc_close(device, token);
    } catch (const std::exception&) {
    }
    if (!ok) TORCH_WARN("fastcomm: stream flag operations cannot be captured into CUDA graphs here; plans' graphs use NCCL");
  });
  return ok;
}

bool ipc_readable(int device, const IpcHandle& h) {
  Wire w;
  std::memcpy(&w, h.bytes.data(), sizeof(w));
  if (w.host) return true;
  int count = 0;
  FASTCOMM_GPU_CHECK(cudaGetDeviceCount(&count));
  for (int d = 0; d < count; ++d) {
    char uuid[16];
    device_uuid(d, uuid);
    if (std::memcmp(uuid, w.uuid, 16) != 0) continue;
    if (d == device) return true;
    int ok = 0;
    FASTCOMM_GPU_CHECK(cudaDeviceCanAccessPeer(&ok, device, d));
    return ok != 0;
  }
  return false;  // not visible here: no peer access to rely on
}

void* ipc_create(int device, size_t bytes, int nflags, IpcHandle* h, IpcBlock* b, bool host) {
  c10::cuda::CUDAGuard g((c10::DeviceIndex)device);
  auto k = std::make_unique<Block>();
  k->creator = true;
  k->host = host;
  std::random_device rd;
  char name[sizeof(Wire::name)];
  std::snprintf(name, sizeof(name), "/fcdipc-%d-%08x%08x", (int)getpid(), rd(), rd());
  k->name = name;
  const size_t fbytes = flags_size(nflags);
  k->flags_size = host ? fbytes + ((bytes + 4095) & ~size_t(4095)) : fbytes;
  k->flags = map_flags(name, k->flags_size, true);
  try {
    FASTCOMM_GPU_CHECK(cudaHostRegister(k->flags, k->flags_size, cudaHostRegisterMapped | cudaHostRegisterPortable));
  } catch (...) {
    munmap(k->flags, k->flags_size);
    shm_unlink(name);
    throw;
  }
  Wire w{};
  w.host = host ? 1 : 0;
  try {
    device_uuid(device, w.uuid);
    if (host) {
      k->data = static_cast<uint8_t*>(k->flags) + fbytes;
      const uint64_t at = fbytes;  // where the data starts in the segment
      std::memcpy(&w.mem, &at, sizeof(at));
    } else {
      FASTCOMM_GPU_CHECK(cudaMalloc(&k->data, bytes));
      FASTCOMM_GPU_CHECK(cudaIpcGetMemHandle(&w.mem, k->data));
    }
  } catch (...) {
    if (host) k->data = nullptr;
    if (k->data != nullptr) FASTCOMM_GPU_WARN(cudaFree(k->data));
    FASTCOMM_GPU_WARN(cudaHostUnregister(k->flags));
    munmap(k->flags, k->flags_size);
    shm_unlink(name);
    throw;
  }
  std::memcpy(w.name, name, std::min(std::strlen(name), sizeof(w.name) - 1));
  std::memcpy(h->bytes.data(), &w, sizeof(w));
  b->data = k->data;
  b->flags = static_cast<uint32_t*>(k->flags);
  return k.release();
}

void* ipc_open(int device, const IpcHandle& h, IpcBlock* b, const IpcClaim& claim) {
  c10::cuda::CUDAGuard g((c10::DeviceIndex)device);
  Wire w;
  std::memcpy(&w, h.bytes.data(), sizeof(w));
  w.name[sizeof(w.name) - 1] = 0;
  auto k = std::make_unique<Block>();
  k->name = w.name;
  struct stat st;
  int fd = shm_open(w.name, O_RDONLY, 0600);
  if (fd < 0 || fstat(fd, &st) != 0) {
    if (fd >= 0) close(fd);
    throw_comm_error(std::string("fastcomm: the peer's IPC flags ") + w.name + " are gone");
  }
  close(fd);
  k->flags_size = (size_t)st.st_size;
  k->flags = map_flags(w.name, k->flags_size, false);
  shm_unlink(w.name);  // both map it now: a crash of either leaves nothing behind
  try {
    FASTCOMM_GPU_CHECK(cudaHostRegister(k->flags, k->flags_size, cudaHostRegisterMapped | cudaHostRegisterPortable));
  } catch (...) {
    munmap(k->flags, k->flags_size);
    throw;
  }
  k->host = w.host != 0;
  auto* flags = static_cast<uint32_t*>(k->flags);
  if (claim.take && !claim.take(flags)) {
    FASTCOMM_GPU_WARN(cudaHostUnregister(k->flags));
    munmap(k->flags, k->flags_size);
    throw_comm_error(std::string("fastcomm: the peer's IPC ring ") + w.name + " was ended before it was mapped here");
  }
  try {
    if (k->host) {
      uint64_t at;
      std::memcpy(&at, &w.mem, sizeof(at));
      k->data = static_cast<uint8_t*>(k->flags) + at;
    } else {
      FASTCOMM_GPU_CHECK(cudaIpcOpenMemHandle(&k->data, w.mem, cudaIpcMemLazyEnablePeerAccess));
    }
  } catch (...) {
    if (claim.give_back) claim.give_back(flags);
    FASTCOMM_GPU_WARN(cudaHostUnregister(k->flags));
    munmap(k->flags, k->flags_size);
    throw;
  }
  b->data = k->data;
  b->flags = static_cast<uint32_t*>(k->flags);
  return k.release();
}

void ipc_close(int device, void* token) {
  std::unique_ptr<Block> k(static_cast<Block*>(token));
  if (!k) return;
  c10::cuda::CUDAGuard g((c10::DeviceIndex)device);
  if (k->host) {
    // The data is in the segment, unmapped below.
  } else if (k->creator) {
    FASTCOMM_GPU_WARN(cudaFree(k->data));
  } else if (k->data != nullptr) {  // (unless ipc_close_data did)
    FASTCOMM_GPU_WARN(cudaIpcCloseMemHandle(k->data));
  }
  FASTCOMM_GPU_WARN(cudaHostUnregister(k->flags));
  munmap(k->flags, k->flags_size);
  if (k->creator) shm_unlink(k->name.c_str());  // never opened: the name is still there
}

void ipc_close_data(int device, void* token) {
  auto* k = static_cast<Block*>(token);
  if (k == nullptr || k->creator || k->host || k->data == nullptr) return;
  c10::cuda::CUDAGuard g((c10::DeviceIndex)device);
  FASTCOMM_GPU_WARN(cudaIpcCloseMemHandle(k->data));
  k->data = nullptr;
}

void flag_write(uint32_t* flag, uint32_t value, cudaStream_t s) {
  // The default flags put a memory fence before the write: the copies before it are visible first.
  check_cu(driver().write(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), value, 0),
           "cuStreamWriteValue32");
}

void flag_wait(cudaStream_t s, const uint32_t* flag, uint32_t value) {
  check_cu(driver().wait(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), value,
                         CU_STREAM_WAIT_VALUE_GEQ),
           "cuStreamWaitValue32");
}

}  // namespace cuda
}  // namespace fastcomm
