#include "util/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace moesrv {

static std::string human(double v, bool bytes) {
  if (!bytes) return fmt::format("{:.0f}", v);
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  return fmt::format("{:.1f} {}", v, units[u]);
}

ProgressBar::ProgressBar(std::string label, uint64_t total, bool bytes)
    : label_(std::move(label)), total_(total), bytes_(bytes) {
  const char* env = std::getenv("MOESRV_PROGRESS");
  enabled_ = env ? std::string(env) == "1" : isatty(STDERR_FILENO);
  start_ = last_draw_ = std::chrono::steady_clock::now();
}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::add(uint64_t n) {
  std::lock_guard lk(mu_);
  done_ += n;
  draw(false);
}

void ProgressBar::set(uint64_t done) {
  std::lock_guard lk(mu_);
  done_ = done;
  draw(false);
}

void ProgressBar::finish() {
  std::lock_guard lk(mu_);
  if (finished_) return;
  finished_ = true;
  draw(true);
}

void ProgressBar::draw(bool final) {
  if (!enabled_) return;
  auto now = std::chrono::steady_clock::now();
  if (!final && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  double secs = std::chrono::duration<double>(now - start_).count();
  double frac = total_ ? double(done_) / double(total_) : 1.0;
  int width = 30, filled = int(frac * width + 0.5);
  std::string bar(size_t(filled), '#');
  bar.resize(size_t(width), '.');
  double rate = secs > 0 ? double(done_) / secs : 0;
  fmt::print(stderr, "\r{} [{}] {:5.1f}% {} / {} ({}/s){}", label_, bar, frac * 100, human(double(done_), bytes_),
             human(double(total_), bytes_), human(rate, bytes_), final ? "\n" : "");
  std::fflush(stderr);
}

}  // namespace moesrv
