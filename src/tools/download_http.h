// Minimal libcurl GET used by the downloader: follows redirects, optional Range and bearer token, streams the
// body to a callback, and records the headers that matter (X-Linked-Etag, ETag, Content-Range, Content-Length).
#pragma once
#include <curl/curl.h>

#include <cstdint>
#include <functional>
#include <string>

namespace moesrv::http {

// What one request (including its redirects) told us.
struct Response {
  long status = 0;
  CURLcode code = CURLE_OK;
  std::string curl_error;
  std::string linked_etag;                          // X-Linked-Etag from any hop (HF: sha256 of LFS files)
  std::string etag, content_range, content_length;  // final hop
  std::string error_body;                           // start of a non-2xx body
  bool ok_status() const { return status == 200 || status == 206; }
};

using DataFn = std::function<bool(const char*, size_t, Response&)>;  // 2xx body bytes; false aborts

struct GetOptions {
  std::string token;  // sent as "Authorization: Bearer" (not forwarded to other hosts on redirect)
  long connect_timeout_s = 30;
  long stall_timeout_s = 60;  // abort when under 1 KiB/s for this long
};

Response get(const std::string& url, const GetOptions& opt, uint64_t range_from, const DataFn& on_data);
// Network errors, 5xx, 408, 429 (and 2xx that ended early) are worth another attempt.
bool retryable(const Response& r);
std::string url_escape(const std::string& s, bool keep_slash);
std::string lower(std::string s);

}  // namespace moesrv::http
