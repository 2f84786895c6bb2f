// Wall-clock seconds on the steady clock (timings in engines, the server and benches).
#pragma once
#include <chrono>

namespace moesrv {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace moesrv
