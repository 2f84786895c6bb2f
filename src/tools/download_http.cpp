#include "tools/download_http.h"

#include <algorithm>
#include <memory>
#include <mutex>

#include "util/error.h"

namespace moesrv::http {

namespace {

std::string trim_etag(std::string v) {
  while (!v.empty() && (v.back() == '\r' || v.back() == '\n' || v.back() == ' ')) v.pop_back();
  if (v.rfind("W/", 0) == 0) v = v.substr(2);
  if (v.size() >= 2 && v.front() == '"' && v.back() == '"') v = v.substr(1, v.size() - 2);
  return lower(v);
}

struct Transfer {
  CURL* curl;
  Response* resp;
  const DataFn* on_data;
};

size_t on_header(char* p, size_t size, size_t n, void* ud) {
  auto* t = static_cast<Transfer*>(ud);
  std::string line(p, size * n);
  while (!line.empty() && (line.back() == '\r' || line.back() == '\n')) line.pop_back();
  if (line.rfind("HTTP/", 0) == 0) {  // a new response in the redirect chain
    t->resp->etag.clear(), t->resp->content_range.clear(), t->resp->content_length.clear();
    return size * n;
  }
  auto colon = line.find(':');
  if (colon == std::string::npos) return size * n;
  std::string name = lower(line.substr(0, colon)), value = line.substr(colon + 1);
  value.erase(0, value.find_first_not_of(' '));
  if (name == "x-linked-etag") t->resp->linked_etag = trim_etag(value);
  else if (name == "etag") t->resp->etag = trim_etag(value);
  else if (name == "content-range") t->resp->content_range = value;
  else if (name == "content-length") t->resp->content_length = value;
  return size * n;
}

size_t on_body(char* p, size_t size, size_t n, void* ud) {
  auto* t = static_cast<Transfer*>(ud);
  curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &t->resp->status);
  if (!t->resp->ok_status()) {
    if (t->resp->error_body.size() < 300) t->resp->error_body.append(p, std::min<size_t>(size * n, 300));
    return size * n;
  }
  return (*t->on_data)(p, size * n, *t->resp) ? size * n : 0;
}

}  // namespace

std::string url_escape(const std::string& s, bool keep_slash) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~' || (keep_slash && c == '/')) out += char(c);
    else out += fmt::format("%{:02X}", c);
  }
  return out;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), ::tolower);
  return s;
}

Response get(const std::string& url, const GetOptions& opt, uint64_t range_from, const DataFn& on_data) {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  std::unique_ptr<CURL, decltype(&curl_easy_cleanup)> curl(curl_easy_init(), curl_easy_cleanup);
  if (!curl) fail("curl_easy_init failed");
  Response resp;
  Transfer t{curl.get(), &resp, &on_data};
  char errbuf[CURL_ERROR_SIZE] = {0};
  curl_slist* headers = nullptr;
  // libcurl does not forward custom Authorization headers to another host on redirect (signed CDN URLs).
  if (!opt.token.empty()) headers = curl_slist_append(headers, ("Authorization: Bearer " + opt.token).c_str());
  std::string range = fmt::format("{}-", range_from);
  CURL* c = curl.get();
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
  curl_easy_setopt(c, CURLOPT_MAXREDIRS, 10L);
  curl_easy_setopt(c, CURLOPT_USERAGENT, "moesrv/0.1");
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, opt.connect_timeout_s);
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1024L);
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, opt.stall_timeout_s);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, errbuf);
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, &t);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &t);
  if (headers) curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  if (range_from > 0) curl_easy_setopt(c, CURLOPT_RANGE, range.c_str());
  resp.code = curl_easy_perform(c);
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &resp.status);
  resp.curl_error = errbuf[0] ? errbuf : curl_easy_strerror(resp.code);
  curl_slist_free_all(headers);
  return resp;
}

bool retryable(const Response& r) {
  if (r.code != CURLE_OK && r.status == 0) return true;  // network: refused, reset, timeout
  return r.status >= 500 || r.status == 408 || r.status == 429 || r.ok_status();
}

}  // namespace moesrv::http
