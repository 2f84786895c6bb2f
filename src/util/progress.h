// A terminal progress bar for long work (download, verify, load). Draws to stderr only when it is a TTY
// (or MOESRV_PROGRESS=1), at most ~10 times a second; silent otherwise.
#pragma once
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace moesrv {

class ProgressBar {
 public:
  ProgressBar(std::string label, uint64_t total, bool bytes = true);
  ~ProgressBar();
  void add(uint64_t n);
  void set(uint64_t done);
  void finish();
  bool enabled() const { return enabled_; }

 private:
  void draw(bool final);
  std::string label_;
  uint64_t total_, done_ = 0;
  bool bytes_, enabled_, finished_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
  std::mutex mu_;
};

}  // namespace moesrv
