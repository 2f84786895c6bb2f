// One exception type for every user-facing failure: the message is what the user reads.
#pragma once
#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace moesrv {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] inline void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

#define MOESRV_CHECK(cond, ...)                  \
  do {                                           \
    if (!(cond)) ::moesrv::fail(__VA_ARGS__);    \
  } while (0)

}  // namespace moesrv
