#include "format/lock.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "format/package.h"
#include "util/error.h"
#include "util/sha256.h"
#include "util/progress.h"

namespace moesrv {

namespace fs = std::filesystem;
using json = nlohmann::json;

PackageLock read_lock(const std::string& path) {
  json j = read_json_file(path);
  if (!j.is_object() || j.value("version", 0) != 1 || !j.contains("files") || !j["files"].is_object())
    fail("{}: not a version-1 checkpoint lock (expected {{\"version\":1,\"files\":{{...}}}})", path);
  PackageLock lock;
  for (auto it = j["files"].begin(); it != j["files"].end(); ++it) {
    const json& e = *it;
    if (!e.is_object() || !e.contains("size") || !e["size"].is_number_unsigned() || !e.contains("sha256") ||
        !e["sha256"].is_string() || !is_sha256_hex(e["sha256"].get<std::string>()))
      fail("{}: entry {} needs an unsigned \"size\" and a 64-hex-digit \"sha256\"", path, it.key());
    std::string h = e["sha256"].get<std::string>();
    std::transform(h.begin(), h.end(), h.begin(), ::tolower);
    lock.files[it.key()] = {e["size"].get<uint64_t>(), h};
  }
  return lock;
}

void write_lock(const std::string& path, const PackageLock& lock) {
  json files = json::object();
  for (const auto& [name, e] : lock.files) files[name] = {{"size", e.size}, {"sha256", e.sha256}};
  json j = {{"version", 1}, {"files", files}};
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) fail("{}: cannot write", tmp);
    out << j.dump(2) << "\n";
    if (!out.flush()) fail("{}: write failed", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("{}: rename failed: {}", path, std::strerror(errno));
}

bool is_sha256_hex(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit((unsigned char)c); });
}

std::string sha256_file(const std::string& path, const std::function<void(uint64_t)>& on_bytes) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail("{}: cannot open: {}", path, std::strerror(errno));
  posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  Sha256 hash;
  constexpr size_t kChunk = 8u << 20;
  std::vector<unsigned char> buf(kChunk);
  for (;;) {
    ssize_t n = ::read(fd, buf.data(), kChunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      fail("{}: read failed: {}", path, std::strerror(err));
    }
    if (n == 0) break;
    hash.update(buf.data(), size_t(n));
    if (on_bytes) on_bytes(uint64_t(n));
  }
  ::close(fd);
  return hash.hex();
}

static bool skipped_name(const std::string& name) {
  auto ends = [&](const char* s) { return name.size() >= std::strlen(s) && name.ends_with(s); };
  return name.empty() || name[0] == '.' || name == kLockFileName || ends(".part") || ends(".tmp") || ends(".bak");
}

std::vector<std::string> list_package_files(const std::string& dir) {
  if (!fs::is_directory(dir)) fail("model directory {} does not exist", dir);
  std::vector<std::string> out;
  for (auto it = fs::recursive_directory_iterator(dir); it != fs::recursive_directory_iterator(); ++it) {
    std::string name = it->path().filename().string();
    if (skipped_name(name)) {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file()) out.push_back(fs::relative(it->path(), dir).generic_string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

struct HashJob {
  std::string rel;
  uint64_t size = 0;
  std::string sha256;  // result
  std::string error;   // read failure
};

// Hashes jobs in parallel (largest first so the big shards start early), one ProgressBar over all bytes.
void hash_jobs(const std::string& dir, std::vector<HashJob>& jobs, const HashOptions& opt, const std::string& label) {
  uint64_t total = 0;
  for (const auto& j : jobs) total += j.size;
  std::vector<size_t> order(jobs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return jobs[a].size > jobs[b].size; });
  int threads = opt.threads > 0 ? opt.threads : int(std::min(4u, std::max(1u, std::thread::hardware_concurrency())));
  threads = int(std::min<size_t>(size_t(threads), std::max<size_t>(1, jobs.size())));
  std::unique_ptr<ProgressBar> bar;
  if (opt.progress) bar = std::make_unique<ProgressBar>(label, total);
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t k; (k = next.fetch_add(1)) < order.size();) {
      HashJob& j = jobs[order[k]];
      try {
        j.sha256 = sha256_file((fs::path(dir) / j.rel).string(), [&](uint64_t n) {
          if (bar) bar->add(n);
        });
      } catch (const std::exception& e) {
        j.error = e.what();
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (bar) bar->finish();
}

}  // namespace

PackageLock build_lock(const std::string& dir, const HashOptions& opt) {
  std::vector<HashJob> jobs;
  for (const auto& rel : list_package_files(dir)) jobs.push_back({rel, fs::file_size(fs::path(dir) / rel), {}, {}});
  hash_jobs(dir, jobs, opt, "lock");
  PackageLock lock;
  for (const auto& j : jobs) {
    if (!j.error.empty()) fail("{}", j.error);
    lock.files[j.rel] = {j.size, j.sha256};
  }
  return lock;
}

PackageLock write_package_lock(const std::string& dir, const HashOptions& opt) {
  PackageLock lock = build_lock(dir, opt);
  write_lock((fs::path(dir) / kLockFileName).string(), lock);
  return lock;
}

const char* file_problem_name(FileProblem p) {
  switch (p) {
    case FileProblem::Missing: return "missing";
    case FileProblem::Truncated: return "truncated";
    case FileProblem::Oversized: return "size mismatch";
    case FileProblem::HashMismatch: return "sha256 mismatch";
    case FileProblem::Unreadable: return "unreadable";
    case FileProblem::NotInLock: return "not in lock";
  }
  return "?";
}

bool VerifyReport::ok() const { return has_lock && error_count() == 0; }

size_t VerifyReport::error_count() const {
  return size_t(std::count_if(issues.begin(), issues.end(), [](const FileIssue& i) { return i.problem != FileProblem::NotInLock; }));
}

std::string VerifyReport::text() const {
  std::string out;
  for (const auto& i : issues)
    out += fmt::format("{}{}: {}{}\n", i.problem == FileProblem::NotInLock ? "WARN " : "FAIL ", i.path,
                       file_problem_name(i.problem), i.detail.empty() ? "" : " (" + i.detail + ")");
  size_t warns = issues.size() - error_count();
  out += fmt::format("{}: {} files checked, {} hashed, {} problem(s){}\n", ok() ? "OK" : "FAILED", files_checked,
                     fmt::format("{:.1f} MiB", double(bytes_hashed) / (1 << 20)), error_count(),
                     warns ? fmt::format(", {} file(s) not in the lock", warns) : "");
  return out;
}

VerifyReport verify_against(const std::string& dir, const PackageLock& lock, const VerifyOptions& opt) {
  VerifyReport rep;
  rep.has_lock = true;
  std::vector<HashJob> jobs;
  std::map<std::string, const LockEntry*> wanted;
  if (opt.only.empty()) {
    for (const auto& [rel, e] : lock.files) wanted[rel] = &e;
  } else {
    for (const auto& rel : opt.only) {
      auto it = lock.files.find(rel);
      if (it == lock.files.end()) rep.issues.push_back({rel, FileProblem::NotInLock, "cannot be verified"});
      else wanted[rel] = &it->second;
    }
  }
  for (const auto& [rel, e] : wanted) {
    fs::path p = fs::path(dir) / rel;
    std::error_code ec;
    if (!fs::is_regular_file(p, ec)) {
      rep.issues.push_back({rel, FileProblem::Missing, fmt::format("expected {} bytes", e->size)});
      continue;
    }
    uint64_t size = fs::file_size(p, ec);
    if (size < e->size) {
      rep.issues.push_back({rel, FileProblem::Truncated, fmt::format("{} of {} bytes", size, e->size)});
    } else if (size > e->size) {
      rep.issues.push_back({rel, FileProblem::Oversized, fmt::format("{} bytes, lock says {}", size, e->size)});
    } else {
      jobs.push_back({rel, size, {}, {}});
    }
    ++rep.files_checked;
  }
  hash_jobs(dir, jobs, opt, "verify");
  for (const auto& j : jobs) {
    rep.bytes_hashed += j.size;
    const LockEntry& e = *wanted[j.rel];
    if (!j.error.empty()) rep.issues.push_back({j.rel, FileProblem::Unreadable, j.error});
    else if (j.sha256 != e.sha256)
      rep.issues.push_back({j.rel, FileProblem::HashMismatch, fmt::format("expected {}, got {}", e.sha256, j.sha256)});
  }
  if (opt.check_unlisted && opt.only.empty())
    for (const auto& rel : list_package_files(dir))
      if (!lock.files.count(rel)) rep.issues.push_back({rel, FileProblem::NotInLock, "present but not listed"});
  std::sort(rep.issues.begin(), rep.issues.end(), [](const FileIssue& a, const FileIssue& b) { return a.path < b.path; });
  return rep;
}

VerifyReport verify_package(const std::string& dir, const VerifyOptions& opt) {
  if (!fs::is_directory(dir)) fail("model directory {} does not exist", dir);
  fs::path lp = fs::path(dir) / kLockFileName;
  if (!fs::exists(lp)) fail("{}: no {}; create one with `moesrv lock --model {}`", dir, kLockFileName, dir);
  return verify_against(dir, read_lock(lp.string()), opt);
}

}  // namespace moesrv
