// Checksum lock for a model package: checkpoint.lock.json records size + SHA-256 of every file, so a
// download or copy of hundreds of GB can be verified before loading.
//   {"version":1,"files":{"<relative path>":{"size":N,"sha256":"hex"}}}
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace moesrv {

inline constexpr const char* kLockFileName = "checkpoint.lock.json";

struct LockEntry {
  uint64_t size = 0;
  std::string sha256;  // lowercase hex
};

struct PackageLock {
  std::map<std::string, LockEntry> files;  // relative path -> entry
};

PackageLock read_lock(const std::string& path);
void write_lock(const std::string& path, const PackageLock& lock);  // atomic (tmp + rename)

// Streams the file through SHA-256 with large reads; on_bytes(n) is called after each chunk.
std::string sha256_file(const std::string& path, const std::function<void(uint64_t)>& on_bytes = {});
bool is_sha256_hex(const std::string& s);

// Every regular file of the package, relative, sorted; skips the lock itself, hidden entries (.cache, .git),
// backups (*.bak) and in-progress files (*.part, *.tmp).
std::vector<std::string> list_package_files(const std::string& dir);

struct HashOptions {
  int threads = 0;        // 0: min(4, cores); files are hashed in parallel
  bool progress = true;   // ProgressBar over total bytes
};

// Hashes every package file and builds a lock (does not write it).
PackageLock build_lock(const std::string& dir, const HashOptions& opt = {});
// build_lock + write to DIR/checkpoint.lock.json; returns the lock.
PackageLock write_package_lock(const std::string& dir, const HashOptions& opt = {});

enum class FileProblem { Missing, Truncated, Oversized, HashMismatch, Unreadable, NotInLock };
const char* file_problem_name(FileProblem p);

struct FileIssue {
  std::string path;  // relative
  FileProblem problem;
  std::string detail;  // human-readable, includes expected/actual numbers
};

struct VerifyOptions : HashOptions {
  std::vector<std::string> only;  // verify just these relative paths (empty: all listed in the lock)
  bool check_unlisted = true;     // report files present but not in the lock (warnings)
};

struct VerifyReport {
  bool has_lock = false;
  size_t files_checked = 0;
  uint64_t bytes_hashed = 0;
  std::vector<FileIssue> issues;  // errors and NotInLock warnings, sorted by path

  // True when every checked file matches (NotInLock entries are warnings only).
  bool ok() const;
  size_t error_count() const;
  // Multi-line human-readable report, one line per issue plus a summary line.
  std::string text() const;
};

// Checks the files listed in DIR/checkpoint.lock.json: size first (a short file is reported as
// truncated without hashing), then SHA-256. Throws Error when the package has no lock.
VerifyReport verify_package(const std::string& dir, const VerifyOptions& opt = {});
// Same against an explicit lock.
VerifyReport verify_against(const std::string& dir, const PackageLock& lock, const VerifyOptions& opt = {});

}  // namespace moesrv
