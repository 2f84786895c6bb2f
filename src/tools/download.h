// Download of a model repository from a Hugging Face-style endpoint (huggingface.co or a mirror):
// file listing from the API, resumable transfers (.part + HTTP Range), retries with backoff, size + SHA-256
// verification (checkpoint.lock.json, else the API's LFS sha256, else X-Linked-Etag), atomic rename.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace moesrv {

class ProgressBar;

struct RemoteFile {
  std::string path;              // relative path in the repo
  std::optional<uint64_t> size;  // when known (API blobs, lock)
  std::string sha256;            // when known (LFS, lock); lowercase hex
};

struct DownloadOptions {
  std::string endpoint = "https://huggingface.co";
  std::string repo;  // owner/name
  std::string revision = "main";
  std::string dir;                   // destination folder
  std::string token;                 // bearer token (default: $HF_TOKEN)
  std::vector<std::string> files;    // explicit file list: skips the API listing
  std::vector<std::string> include;  // glob patterns (fnmatch) filtering the listing; empty: everything
  std::string lock_file;             // local checkpoint.lock.json to verify against (else the repo's own, if any)
  int max_attempts = 6;              // per file, counting the first
  double backoff_s = 1.0;            // doubled after each failed attempt
  double backoff_max_s = 60.0;
  long connect_timeout_s = 30;
  long stall_timeout_s = 60;  // abort + resume when under 1 KiB/s for this long
  bool progress = true;
  std::function<void(const std::string&)> log;  // retry/skip notes; default: stderr
};

struct DownloadedFile {
  std::string path;
  uint64_t size = 0;
  std::string sha256;     // of the file on disk
  bool verified = false;  // sha256 matched a known value (lock, API, or X-Linked-Etag)
  bool skipped = false;   // already complete on disk
  int attempts = 0;       // HTTP requests made
  uint64_t bytes_transferred = 0;
};

struct DownloadReport {
  std::vector<DownloadedFile> files;
  uint64_t bytes_transferred = 0;
  std::string text() const;
};

std::string hf_api_url(const DownloadOptions& opt);  // {endpoint}/api/models/{repo}/revision/{rev}
std::string hf_file_url(const DownloadOptions& opt, const std::string& path);  // {endpoint}/{repo}/resolve/{rev}/{path}

// The repo's files from the API ("siblings"; sizes and LFS sha256 when the endpoint reports them).
std::vector<RemoteFile> list_remote_files(const DownloadOptions& opt);

// One file: url -> dest via dest.part, resuming a .part left by an earlier run. Throws Error on 4xx,
// after max_attempts failures, or when size/sha256 do not match `expect` (the .part is then removed).
DownloadedFile download_file(const std::string& url, const std::string& dest, const RemoteFile& expect,
                             const DownloadOptions& opt, ProgressBar* bar = nullptr, uint64_t bar_base = 0);

// Lists (or takes opt.files), downloads checkpoint.lock.json first when present, then every file.
DownloadReport download_repo(const DownloadOptions& opt);

}  // namespace moesrv
