#include "tools/download.h"

#include "tools/download_http.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "format/lock.h"
#include "util/error.h"
#include "util/progress.h"
#include "util/sha256.h"

namespace moesrv {

namespace fs = std::filesystem;
using json = nlohmann::json;
using http::lower;
using http::Response;
using http::retryable;
using http::url_escape;

namespace {

Response http_get(const std::string& url, const DownloadOptions& opt, uint64_t range_from,
                  const http::DataFn& on_data) {
  return http::get(url, {opt.token, opt.connect_timeout_s, opt.stall_timeout_s}, range_from, on_data);
}

// A clear message for a failure that retrying cannot fix.
[[noreturn]] void fail_http(const std::string& what, const std::string& url, const Response& r,
                            const DownloadOptions& opt) {
  std::string body = r.error_body.empty() ? "" : ": " + r.error_body.substr(0, 200);
  if (r.status == 404) fail("{}: not found (HTTP 404) at {}{}", what, url, body);
  if (r.status == 401 || r.status == 403)
    fail("{}: access denied (HTTP {}) at {}{}{}", what, r.status, url,
         opt.token.empty() ? "; private or gated repos need --token or $HF_TOKEN"
                           : "; check that the token can read this repo",
         body);
  fail("{}: HTTP {} at {}{}", what, r.status, url, body);
}

void sleep_backoff(const DownloadOptions& opt, int failures) {
  double s = std::min(opt.backoff_max_s, opt.backoff_s * std::pow(2.0, failures - 1));
  std::this_thread::sleep_for(std::chrono::duration<double>(s));
}

void log_line(const DownloadOptions& opt, const std::string& msg) {
  if (opt.log) opt.log(msg);
  else fmt::print(stderr, "\n{}\n", msg);
}

uint64_t range_start(const std::string& content_range) {  // "bytes START-END/TOTAL"
  auto sp = content_range.find(' ');
  return sp == std::string::npos ? UINT64_MAX : std::strtoull(content_range.c_str() + sp + 1, nullptr, 10);
}

uint64_t total_from(const Response& r, uint64_t start) {
  auto slash = r.content_range.find('/');
  if (slash != std::string::npos && r.content_range[slash + 1] != '*')
    return std::strtoull(r.content_range.c_str() + slash + 1, nullptr, 10);
  if (!r.content_length.empty()) return start + std::strtoull(r.content_length.c_str(), nullptr, 10);
  return 0;  // unknown (chunked)
}

void hash_existing(const std::string& path, Sha256& h) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail("{}: cannot open: {}", path, std::strerror(errno));
  std::vector<char> buf(8u << 20);
  for (ssize_t n; (n = ::read(fd, buf.data(), buf.size())) > 0;) h.update(buf.data(), size_t(n));
  ::close(fd);
}

bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w, n -= size_t(w);
  }
  return true;
}

}  // namespace

std::string hf_api_url(const DownloadOptions& opt) {
  return fmt::format("{}/api/models/{}/revision/{}", opt.endpoint, url_escape(opt.repo, true),
                     url_escape(opt.revision, false));
}

std::string hf_file_url(const DownloadOptions& opt, const std::string& path) {
  return fmt::format("{}/{}/resolve/{}/{}", opt.endpoint, url_escape(opt.repo, true), url_escape(opt.revision, false),
                     url_escape(path, true));
}

std::vector<RemoteFile> list_remote_files(const DownloadOptions& opt) {
  std::string url = hf_api_url(opt) + "?blobs=true";
  std::string what = fmt::format("repository {} (revision {})", opt.repo, opt.revision);
  for (int attempt = 1;; ++attempt) {
    std::string body;
    Response r = http_get(url, opt, 0, [&](const char* p, size_t n, Response&) {
      body.append(p, n);
      return true;
    });
    if (r.code == CURLE_OK && r.status == 200) {
      json j;
      try {
        j = json::parse(body);
      } catch (const json::exception& e) {
        fail("{}: the API answer is not JSON ({}) at {}", what, e.what(), url);
      }
      if (!j.contains("siblings") || !j["siblings"].is_array())
        fail("{}: the API answer has no \"siblings\" list at {}", what, url);
      std::vector<RemoteFile> out;
      for (const auto& s : j["siblings"]) {
        if (!s.contains("rfilename") || !s["rfilename"].is_string()) continue;
        RemoteFile f{s["rfilename"].get<std::string>(), std::nullopt, {}};
        if (s.contains("size") && s["size"].is_number_unsigned()) f.size = s["size"].get<uint64_t>();
        if (s.contains("lfs") && s["lfs"].is_object()) {
          const json& l = s["lfs"];
          if (l.contains("sha256") && l["sha256"].is_string() && is_sha256_hex(l["sha256"].get<std::string>()))
            f.sha256 = lower(l["sha256"].get<std::string>());
          if (l.contains("size") && l["size"].is_number_unsigned()) f.size = l["size"].get<uint64_t>();
        }
        out.push_back(std::move(f));
      }
      return out;
    }
    if (!retryable(r) || r.status == 200 || attempt >= opt.max_attempts) {
      if (r.status >= 400) fail_http(what, url, r, opt);
      fail("{}: cannot list files at {}: {}", what, url, r.curl_error);
    }
    log_line(opt, fmt::format("listing {}: {} (attempt {}/{}), retrying", opt.repo,
                              r.status ? fmt::format("HTTP {}", r.status) : r.curl_error, attempt, opt.max_attempts));
    sleep_backoff(opt, attempt);
  }
}

DownloadedFile download_file(const std::string& url, const std::string& dest, const RemoteFile& expect,
                             const DownloadOptions& opt, ProgressBar* bar, uint64_t bar_base) {
  DownloadedFile out;
  out.path = expect.path.empty() ? dest : expect.path;
  std::string part = dest + ".part";
  fs::create_directories(fs::path(dest).parent_path());
  Sha256 hasher;
  uint64_t have = 0;
  if (fs::exists(part)) {  // resume what an earlier run left
    uint64_t sz = fs::file_size(part);
    if (expect.size && sz > *expect.size) fs::resize_file(part, 0);
    else hash_existing(part, hasher), have = sz;
  }
  auto restart = [&] {
    hasher.reset();
    have = 0;
    fs::resize_file(part, 0);
  };
  std::string header_sha, last_error = "no attempt made";
  bool fresh_retry_used = false;
  int failures = 0;
  for (;;) {
    bool complete = expect.size && have == *expect.size;
    if (!complete) {
      if (out.attempts >= opt.max_attempts)
        fail("{}: download failed after {} attempts: {} ({})", out.path, out.attempts, last_error, url);
      if (failures > 0) sleep_backoff(opt, failures);
      ++out.attempts;
      int fd = ::open(part.c_str(), O_WRONLY | O_CREAT, 0644);
      if (fd < 0) fail("{}: cannot write: {}", part, std::strerror(errno));
      if (::ftruncate(fd, off_t(have)) != 0 || ::lseek(fd, off_t(have), SEEK_SET) < 0)
        fail("{}: cannot seek: {}", part, std::strerror(errno));
      uint64_t start = have;
      bool first = true, bad_range = false, write_failed = false;
      Response r = http_get(url, opt, have, [&](const char* p, size_t n, Response& resp) {
        if (first) {
          first = false;
          if (resp.status == 200 && have > 0) {  // server ignored Range: the body starts at byte 0
            log_line(opt, fmt::format("{}: server ignored the resume request; restarting from byte 0", out.path));
            hasher.reset();
            have = start = 0;
            if (::ftruncate(fd, 0) != 0 || ::lseek(fd, 0, SEEK_SET) < 0) return write_failed = true, false;
          } else if (resp.status == 206 && range_start(resp.content_range) != have) {
            return bad_range = true, false;
          }
        }
        if (!write_all(fd, p, n)) return write_failed = true, false;
        hasher.update(p, n);
        have += n;
        out.bytes_transferred += n;
        if (bar) bar->set(bar_base + have);
        return true;
      });
      ::close(fd);
      if (write_failed) fail("{}: cannot write: {}", part, std::strerror(errno));
      if (!r.linked_etag.empty() && is_sha256_hex(r.linked_etag)) header_sha = r.linked_etag;
      else if (header_sha.empty() && is_sha256_hex(r.etag)) header_sha = r.etag;
      if (bad_range) {
        last_error = "server answered a different range (" + r.content_range + ")";
        restart();
        ++failures;
        continue;
      }
      if (r.status == 416) {  // our .part is not a prefix the server can continue
        last_error = "server rejected the resume offset (HTTP 416)";
        restart();
        continue;
      }
      if (!retryable(r)) fail_http(out.path, url, r, opt);
      if (r.code == CURLE_OK && r.ok_status()) {
        uint64_t want = expect.size ? *expect.size : total_from(r, start);
        if (want == 0 || have == want) complete = true;
        else if (have > want) last_error = fmt::format("received {} bytes, expected {}", have, want), restart();
        else last_error = fmt::format("connection ended at byte {} of {}", have, want);
      } else {
        last_error = r.code != CURLE_OK ? r.curl_error : fmt::format("HTTP {}", r.status);
      }
      if (!complete) {
        ++failures;
        log_line(opt, fmt::format("{}: {} (attempt {}/{}); resuming at byte {}", out.path, last_error, out.attempts,
                                  opt.max_attempts, have));
        continue;
      }
    }
    // Complete: check size and hash before the file takes its final name.
    std::string sha = hasher.hex();
    const std::string& want_sha = expect.sha256.empty() ? header_sha : expect.sha256;
    if (expect.size && have != *expect.size) fail("{}: size {} != expected {}", out.path, have, *expect.size);
    if (!want_sha.empty() && sha != want_sha) {
      fs::remove(part);
      std::string source = expect.sha256.empty() ? "X-Linked-Etag/ETag" : "lock/API";
      if (!fresh_retry_used) {
        fresh_retry_used = true;
        log_line(opt, fmt::format("{}: sha256 mismatch (expected {} from {}, got {}); downloading again from scratch",
                                  out.path, want_sha, source, sha));
        hasher.reset();
        have = 0;
        continue;
      }
      fail("{}: sha256 mismatch after download: expected {} (from {}), got {}; the corrupt file was removed", out.path,
           want_sha, source, sha);
    }
    int fd = ::open(part.c_str(), O_RDONLY);
    if (fd >= 0) ::fsync(fd), ::close(fd);
    if (std::rename(part.c_str(), dest.c_str()) != 0) fail("{}: rename failed: {}", dest, std::strerror(errno));
    out.size = have;
    out.sha256 = sha;
    out.verified = !want_sha.empty();
    return out;
  }
}

std::string DownloadReport::text() const {
  std::string out;
  uint64_t total = 0;
  for (const auto& f : files) {
    total += f.size;
    out += fmt::format("{} {} ({} bytes, sha256 {}{})\n", f.skipped ? "kept      " : "downloaded", f.path, f.size,
                       f.sha256.substr(0, 16), f.verified ? ", verified" : ", no reference hash");
  }
  out += fmt::format("{} files, {:.2f} GiB on disk, {:.2f} GiB transferred\n", files.size(),
                     double(total) / (1ull << 30), double(bytes_transferred) / (1ull << 30));
  return out;
}

static void check_relative_path(const std::string& p) {
  fs::path rel(p);
  bool bad = p.empty() || rel.is_absolute();
  for (const auto& part : rel) bad = bad || part == "..";
  if (bad) fail("refusing to download {}: not a plain relative path inside the repository", p);
}

DownloadReport download_repo(const DownloadOptions& in) {
  DownloadOptions opt = in;
  if (opt.repo.empty() || opt.repo.find('/') == std::string::npos)
    fail("--repo must look like owner/name, got '{}'", opt.repo);
  if (opt.dir.empty()) fail("no destination directory (--dir)");
  if (opt.token.empty())
    for (const char* var : {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"})
      if (const char* v = std::getenv(var); v && *v) {
        opt.token = v;
        break;
      }
  while (!opt.endpoint.empty() && opt.endpoint.back() == '/') opt.endpoint.pop_back();
  fs::create_directories(opt.dir);

  std::vector<RemoteFile> files;
  if (!opt.files.empty()) {
    for (const auto& f : opt.files) files.push_back({f, std::nullopt, {}});
  } else {
    files = list_remote_files(opt);
  }
  if (!opt.include.empty())
    std::erase_if(files, [&](const RemoteFile& f) {
      if (f.path == kLockFileName) return false;
      return std::none_of(opt.include.begin(), opt.include.end(),
                          [&](const std::string& g) { return fnmatch(g.c_str(), f.path.c_str(), 0) == 0; });
    });
  for (const auto& f : files) check_relative_path(f.path);

  DownloadReport rep;
  std::optional<PackageLock> lock;
  if (!opt.lock_file.empty()) lock = read_lock(opt.lock_file);
  auto lock_it = std::find_if(files.begin(), files.end(), [](const RemoteFile& f) { return f.path == kLockFileName; });
  if (lock_it != files.end()) {  // small: always fetched fresh, then it vouches for everything else
    std::string dest = (fs::path(opt.dir) / kLockFileName).string();
    rep.files.push_back(download_file(hf_file_url(opt, kLockFileName), dest, *lock_it, opt));
    rep.bytes_transferred += rep.files.back().bytes_transferred;
    if (!lock) lock = read_lock(dest);
    files.erase(lock_it);
  }
  if (lock)
    for (auto& f : files)
      if (auto e = lock->files.find(f.path); e != lock->files.end()) {
        if (!f.sha256.empty() && f.sha256 != e->second.sha256)
          log_line(opt, fmt::format("{}: the lock and the API disagree on sha256; using the lock", f.path));
        f.size = e->second.size;
        f.sha256 = e->second.sha256;
      }

  uint64_t total = 0;
  for (const auto& f : files) total += f.size.value_or(0);
  std::unique_ptr<ProgressBar> bar;
  if (opt.progress) bar = std::make_unique<ProgressBar>("download", total);
  uint64_t base = 0;
  for (const auto& f : files) {
    std::string dest = (fs::path(opt.dir) / f.path).string();
    DownloadedFile d;
    bool done = false;
    if (fs::is_regular_file(dest) && (!f.size || fs::file_size(dest) == *f.size)) {
      d.path = f.path;
      d.size = fs::file_size(dest);
      d.skipped = true;
      if (f.sha256.empty()) {
        done = true;  // nothing to check it against
        d.sha256 = sha256_file(dest);
      } else if ((d.sha256 = sha256_file(dest)) == f.sha256) {
        done = d.verified = true;
      } else {
        log_line(opt, fmt::format("{}: file on disk fails sha256; downloading it again", f.path));
      }
    }
    if (!done) d = download_file(hf_file_url(opt, f.path), dest, f, opt, bar.get(), base);
    base += d.size;
    if (bar) bar->set(base);
    rep.bytes_transferred += d.bytes_transferred;
    rep.files.push_back(d);
  }
  if (bar) bar->finish();
  return rep;
}

}  // namespace moesrv
