#pragma once
// Error conventions of fastcomm:
//  - user input: TORCH_CHECK / TORCH_CHECK_VALUE / TORCH_CHECK_TYPE, with a message naming the
//    rank, the group and the argument at fault (they surface as RuntimeError/ValueError/TypeError);
//  - invariants: TORCH_INTERNAL_ASSERT;
//  - transport and peer failures (death, stall, mismatch seen on the wire): CommError, which
//    torch translates into torch.distributed.DistBackendError in Python.
#include <c10/util/Exception.h>
#include <cerrno>
#include <cstring>
#include <exception>
#include <string>

namespace fastcomm {

[[noreturn]] inline void throw_comm_error(const std::string& msg) {
  C10_THROW_ERROR(DistBackendError, msg);
}

// The same error as a value, for an op or a Work to hold and raise later.
inline std::exception_ptr comm_error_ptr(const std::string& msg) {
  return std::make_exception_ptr(c10::DistBackendError({__func__, __FILE__, (uint32_t)__LINE__}, msg));
}

inline std::string errno_str(int e) {
  return std::string(std::strerror(e));
}

}  // namespace fastcomm

// A failed system call on the data or setup path is a transport failure, not a user error.
#define FASTCOMM_SYSCHECK(expr, what)                                                  \
  do {                                                                                 \
    if (!(expr)) {                                                                     \
      int fastcomm_errno_ = errno;                                                     \
      ::fastcomm::throw_comm_error(std::string("fastcomm: ") + (what) + " failed: " + \
                                   ::fastcomm::errno_str(fastcomm_errno_) + " (" +     \
                                   __FILE__ + ":" + std::to_string(__LINE__) + ")");   \
    }                                                                                  \
  } while (0)
