#pragma once
// A minimal test framework for the C++ unit tests (gtest is not on PyPI, and CI installs
// nothing with apt). TEST(name) registers a test; CHECK* record a failure and go on,
// REQUIRE* record it and end the test (for checks whose failure makes the rest meaningless,
// such as a null pointer). main.cpp runs them.

// c10's logging header defines glog-style CHECK macros: take it first, so its include guard
// keeps it from coming back after the #undefs below, whatever a test includes later.
#if __has_include(<c10/util/Logging.h>)
#include <c10/util/Logging.h>
#endif

#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace unit {

struct TestCase {
  std::string name;
  std::function<void()> fn;
};

inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}

struct Registrar {
  Registrar(const char* name, std::function<void()> fn) { registry().push_back({name, std::move(fn)}); }
};

// Failures of the running test, as "file:line: message".
inline std::vector<std::string>& failures() {
  static std::vector<std::string> f;
  return f;
}

// Thrown by REQUIRE* to leave the test; main() catches it.
struct Abort {};

inline void fail(const char* file, int line, const std::string& msg) {
  std::ostringstream os;
  os << file << ":" << line << ": " << msg;
  failures().push_back(os.str());
}

// Printable form of a checked value: 8-bit integers as numbers (not characters), pointers
// and enums as integers.
template <typename T>
std::string show(const T& v) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, bool>) {
    os << (v ? "true" : "false");
  } else if constexpr (std::is_enum_v<T>) {
    os << static_cast<int64_t>(v);
  } else if constexpr (std::is_integral_v<T> && sizeof(T) == 1) {
    os << static_cast<int>(v);
  } else if constexpr (std::is_pointer_v<T> || std::is_null_pointer_v<T>) {
    os << static_cast<const void*>(v);
  } else {
    os.precision(17);
    os << v;
  }
  return os.str();
}

template <typename A, typename B>
bool check_eq(const A& a, const B& b, const char* ea, const char* eb, const char* file, int line) {
  // Compare like-signed integers without the usual-conversion surprises (-1 == SIZE_MAX).
  bool ok;
  if constexpr (std::is_integral_v<A> && std::is_integral_v<B> && !std::is_same_v<A, bool> &&
                !std::is_same_v<B, bool>) {
    ok = std::cmp_equal(a, b);
  } else {
    ok = (a == b);
  }
  if (!ok) fail(file, line, std::string("CHECK_EQ(") + ea + ", " + eb + "): " + show(a) + " != " + show(b));
  return ok;
}

}  // namespace unit

#undef CHECK
#undef CHECK_MSG
#undef CHECK_EQ
#undef CHECK_THROWS
#undef REQUIRE
#undef REQUIRE_EQ

#define UNIT_CAT2(a, b) a##b
#define UNIT_CAT(a, b) UNIT_CAT2(a, b)

#define TEST(name)                                                                          \
  static void unit_test_##name();                                                           \
  static ::unit::Registrar UNIT_CAT(unit_reg_, name)(#name, &unit_test_##name);             \
  static void unit_test_##name()

#define CHECK(cond)                                                         \
  ([&]() -> bool {                                                          \
    if (cond) return true;                                                  \
    ::unit::fail(__FILE__, __LINE__, std::string("CHECK(") + #cond + ")"); \
    return false;                                                           \
  }())

#define CHECK_MSG(cond, msg)                                                                   \
  ([&]() -> bool {                                                                             \
    if (cond) return true;                                                                     \
    std::ostringstream unit_os_;                                                               \
    unit_os_ << "CHECK(" << #cond << "): " << msg;                                             \
    ::unit::fail(__FILE__, __LINE__, unit_os_.str());                                          \
    return false;                                                                              \
  }())

#define CHECK_EQ(a, b) ::unit::check_eq((a), (b), #a, #b, __FILE__, __LINE__)

#define REQUIRE(cond) \
  do {                \
    if (!CHECK(cond)) throw ::unit::Abort{}; \
  } while (0)

#define REQUIRE_EQ(a, b) \
  do {                   \
    if (!CHECK_EQ(a, b)) throw ::unit::Abort{}; \
  } while (0)

// `expr` must throw an exception of type `type` (or derived from it).
#define CHECK_THROWS(expr, type)                                                              \
  do {                                                                                        \
    bool unit_threw_ = false;                                                                 \
    try {                                                                                     \
      (void)(expr);                                                                           \
    } catch (const type&) {                                                                   \
      unit_threw_ = true;                                                                     \
    } catch (...) {                                                                           \
      ::unit::fail(__FILE__, __LINE__, std::string(#expr) + " threw, but not " + #type);      \
      unit_threw_ = true;                                                                     \
    }                                                                                         \
    if (!unit_threw_) ::unit::fail(__FILE__, __LINE__, std::string(#expr) + " did not throw " + #type); \
  } while (0)
