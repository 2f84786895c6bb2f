// download against a fake Hugging Face hub (cpp-httplib on loopback).
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "format/lock.h"
#include "test_lock_helpers.h"
#include "tools/download.h"
#include "util/error.h"

using namespace moesrv;
using namespace moesrv::testutil;
using json = nlohmann::json;

namespace {

std::string random_bytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = char(rng());
  return s;
}

std::string sha_of(const std::string& data) {
  TempDir d("sha");
  write_file(d / "x", data);
  return sha256_file(d / "x");
}

// Serves owner/name at revision main: API listing (with LFS sha256 for *.safetensors) and resolve URLs.
class FakeHub {
 public:
  struct File {
    std::string served;          // bytes the server sends
    std::string advertised_sha;  // lfs.sha256 in the listing ("" = not LFS)
    size_t drop_at = 0;          // first drop_times requests close the connection after this many bytes
    int drop_times = 0;
    bool ignore_range = false;   // answer 200 with the whole file (chunked) even to a Range request
    bool redirect = false;       // 302 to /cdn/... carrying X-Linked-Etag (sha of `linked_sha`)
    std::string linked_sha;
    int fail_503_times = 0;
  };
  std::map<std::string, File> files;
  std::mutex mu;
  std::map<std::string, std::vector<std::string>> ranges;  // path -> Range header of each request
  std::vector<std::string> auth_headers;
  int port = 0;

  FakeHub() {
    server_.Get(R"(/api/models/owner/name/revision/main)", [this](const httplib::Request& req, httplib::Response& res) {
      json sib = json::array();
      for (const auto& [p, f] : files) {
        json s = {{"rfilename", p}, {"size", f.served.size()}};
        if (!f.advertised_sha.empty()) s["lfs"] = {{"sha256", f.advertised_sha}, {"size", f.served.size()}, {"pointerSize", 134}};
        sib.push_back(s);
      }
      res.set_content(json{{"id", "owner/name"}, {"sha", "0123"}, {"siblings", sib}}.dump(), "application/json");
    });
    server_.Get(R"(/owner/name/resolve/main/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
      serve(req.matches[1], req, res, false);
    });
    server_.Get(R"(/cdn/(.+))", [this](const httplib::Request& req, httplib::Response& res) { serve(req.matches[1], req, res, true); });
    port = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeHub() {
    server_.stop();
    thread_.join();
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port); }
  size_t requests(const std::string& p) {
    std::lock_guard lk(mu);
    return ranges[p].size();
  }

 private:
  void serve(const std::string& path, const httplib::Request& req, httplib::Response& res, bool from_cdn) {
    std::unique_lock lk(mu);
    auto it = files.find(path);
    if (it == files.end()) {
      res.status = 404;
      res.set_content("Entry not found", "text/plain");
      return;
    }
    File& f = it->second;
    if (f.redirect && !from_cdn) {
      res.set_redirect("/cdn/" + path);
      res.set_header("X-Linked-Etag", "\"" + f.linked_sha + "\"");
      res.set_header("X-Linked-Size", std::to_string(f.served.size()));
      return;
    }
    ranges[path].push_back(req.get_header_value("Range"));
    auth_headers.push_back(req.get_header_value("Authorization"));
    if (f.fail_503_times > 0) {
      --f.fail_503_times;
      res.status = 503;
      res.set_content("busy", "text/plain");
      return;
    }
    auto data = std::make_shared<std::string>(f.served);
    if (f.ignore_range) {
      res.status = 200;
      res.set_chunked_content_provider("application/octet-stream", [data](size_t off, httplib::DataSink& sink) {
        if (off >= data->size()) return sink.done(), true;
        size_t n = std::min<size_t>(65536, data->size() - off);
        return sink.write(data->data() + off, n);
      });
      return;
    }
    size_t drop = 0;
    if (f.drop_times > 0) --f.drop_times, drop = f.drop_at;
    res.set_content_provider(data->size(), "application/octet-stream", [data, drop](size_t off, size_t len, httplib::DataSink& sink) {
      size_t n = std::min<size_t>(len, 65536);
      if (drop && off + n > drop) {
        if (off < drop) sink.write(data->data() + off, drop - off);
        return false;  // close the connection mid-file
      }
      return sink.write(data->data() + off, n);
    });
  }
  httplib::Server server_;
  std::thread thread_;
};

DownloadOptions options(const FakeHub& hub, const std::string& dir) {
  DownloadOptions o;
  o.endpoint = hub.endpoint();
  o.repo = "owner/name";
  o.dir = dir;
  o.progress = false;
  o.backoff_s = 0.01;
  o.max_attempts = 4;
  o.log = [](const std::string&) {};
  return o;
}

void add(FakeHub& hub, const std::string& path, const std::string& data, bool lfs) {
  hub.files[path] = {data, lfs ? sha_of(data) : "", 0, 0, false, false, "", 0};
}

const DownloadedFile& find(const DownloadReport& r, const std::string& p) {
  for (const auto& f : r.files)
    if (f.path == p) return f;
  throw std::runtime_error("no report entry for " + p);
}

}  // namespace

TEST(Download, WholeRepoWithListingAndLfsHashes) {
  FakeHub hub;
  add(hub, "config.json", R"({"model_type":"toy"})", false);
  add(hub, "model.safetensors", random_bytes(300000, 1), true);
  add(hub, "tokenizer/tokenizer.json", "{}", false);
  TempDir d;
  DownloadOptions o = options(hub, d.str());
  o.token = "secret";
  DownloadReport r = download_repo(o);
  ASSERT_EQ(r.files.size(), 3u);
  for (const auto& [p, f] : hub.files) EXPECT_EQ(read_file(d / p), f.served) << p;
  EXPECT_TRUE(find(r, "model.safetensors").verified);
  EXPECT_FALSE(find(r, "config.json").verified);
  EXPECT_FALSE(fs::exists(d / "model.safetensors.part"));
  EXPECT_EQ(r.bytes_transferred, 300000u + hub.files["config.json"].served.size() + 2);
  EXPECT_EQ(hub.auth_headers.at(0), "Bearer secret");

  // A second run finds everything in place and transfers nothing.
  DownloadReport again = download_repo(o);
  EXPECT_EQ(again.bytes_transferred, 0u);
  EXPECT_TRUE(find(again, "model.safetensors").skipped);
  EXPECT_EQ(hub.requests("model.safetensors"), 1u);
}

TEST(Download, ResumesAfterTheServerDropsTheConnection) {
  FakeHub hub;
  std::string big = random_bytes(3 << 20, 2);
  add(hub, "model.safetensors", big, true);
  hub.files["model.safetensors"].drop_at = 1 << 20;
  hub.files["model.safetensors"].drop_times = 1;
  TempDir d;
  DownloadReport r = download_repo(options(hub, d.str()));
  EXPECT_EQ(read_file(d / "model.safetensors"), big);
  const auto& f = find(r, "model.safetensors");
  EXPECT_TRUE(f.verified);
  EXPECT_EQ(f.attempts, 2);
  EXPECT_EQ(f.bytes_transferred, big.size());  // nothing fetched twice
  ASSERT_EQ(hub.requests("model.safetensors"), 2u);
  EXPECT_EQ(hub.ranges["model.safetensors"][0], "");
  EXPECT_EQ(hub.ranges["model.safetensors"][1], "bytes=1048576-");
}

TEST(Download, ContinuesAPartFileFromAnEarlierRun) {
  FakeHub hub;
  std::string big = random_bytes(1 << 20, 3);
  add(hub, "model.safetensors", big, true);
  TempDir d;
  write_file(d / "model.safetensors.part", big.substr(0, 400000));
  DownloadReport r = download_repo(options(hub, d.str()));
  EXPECT_EQ(read_file(d / "model.safetensors"), big);
  EXPECT_EQ(find(r, "model.safetensors").bytes_transferred, big.size() - 400000);
  EXPECT_EQ(hub.ranges["model.safetensors"].at(0), "bytes=400000-");
}

TEST(Download, RestartsWhenTheServerIgnoresRange) {
  FakeHub hub;
  std::string big = random_bytes(1 << 20, 4);
  add(hub, "model.safetensors", big, true);
  hub.files["model.safetensors"].ignore_range = true;
  TempDir d;
  write_file(d / "model.safetensors.part", big.substr(0, 400000));
  DownloadOptions o = options(hub, d.str());
  std::string log;
  o.log = [&](const std::string& m) { log += m + "\n"; };
  DownloadReport r = download_repo(o);
  EXPECT_EQ(read_file(d / "model.safetensors"), big);
  EXPECT_TRUE(find(r, "model.safetensors").verified);
  EXPECT_EQ(find(r, "model.safetensors").bytes_transferred, big.size());  // whole body, written from byte 0
  EXPECT_NE(log.find("server ignored the resume request"), std::string::npos) << log;
  EXPECT_EQ(hub.ranges["model.safetensors"].at(0), "bytes=400000-");
}

TEST(Download, CorruptFileFailsVerificationAndIsRemoved) {
  FakeHub hub;
  std::string good = random_bytes(200000, 5);
  add(hub, "model.safetensors", good, true);
  hub.files["model.safetensors"].served[1234] ^= 0x40;  // server sends a bad byte; listing keeps the true hash
  TempDir d;
  try {
    download_repo(options(hub, d.str()));
    FAIL() << "expected a verification error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("model.safetensors: sha256 mismatch"), std::string::npos) << m;
    EXPECT_NE(m.find(sha_of(good)), std::string::npos) << m;
  }
  EXPECT_FALSE(fs::exists(d / "model.safetensors"));
  EXPECT_FALSE(fs::exists(d / "model.safetensors.part"));
  EXPECT_EQ(hub.requests("model.safetensors"), 2u);  // one fresh re-download before giving up
}

TEST(Download, RepoLockVouchesForNonLfsFiles) {
  FakeHub hub;
  std::string cfg = R"({"model_type":"toy"})";
  add(hub, "config.json", cfg, false);
  add(hub, "model.safetensors", random_bytes(50000, 6), true);
  PackageLock lock;
  lock.files["config.json"] = {cfg.size(), sha_of(cfg)};
  lock.files["model.safetensors"] = {50000, hub.files["model.safetensors"].advertised_sha};
  TempDir src;
  write_lock(src / kLockFileName, lock);
  add(hub, kLockFileName, read_file(src / kLockFileName), false);
  TempDir d;
  DownloadReport r = download_repo(options(hub, d.str()));
  EXPECT_TRUE(find(r, "config.json").verified);
  EXPECT_TRUE(find(r, "model.safetensors").verified);
  VerifyOptions vo;
  vo.progress = false;
  EXPECT_TRUE(verify_package(d.str(), vo).ok());

  // The server now sends a different config.json (same size): the lock catches it.
  hub.files["config.json"].served = R"({"model_type":"bad"})";
  TempDir d2;
  try {
    download_repo(options(hub, d2.str()));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json: sha256 mismatch"), std::string::npos) << e.what();
  }
}

TEST(Download, RedirectAndXLinkedEtagWithExplicitFileList) {
  FakeHub hub;
  std::string data = random_bytes(70000, 7);
  add(hub, "model-00001-of-00002.safetensors", data, false);  // not listed as LFS: only the header knows the hash
  auto& f = hub.files["model-00001-of-00002.safetensors"];
  f.redirect = true;
  f.linked_sha = sha_of(data);
  TempDir d;
  DownloadOptions o = options(hub, d.str());
  o.files = {"model-00001-of-00002.safetensors"};
  DownloadReport r = download_repo(o);
  EXPECT_EQ(read_file(d / "model-00001-of-00002.safetensors"), data);
  EXPECT_TRUE(r.files.at(0).verified);

  f.linked_sha = sha_of("something else");
  TempDir d2;
  o.dir = d2.str();
  EXPECT_THROW(download_repo(o), Error);
  EXPECT_FALSE(fs::exists(d2 / "model-00001-of-00002.safetensors"));
}

TEST(Download, RetriesTransientServerErrors) {
  FakeHub hub;
  add(hub, "model.safetensors", random_bytes(10000, 8), true);
  hub.files["model.safetensors"].fail_503_times = 2;
  TempDir d;
  DownloadReport r = download_repo(options(hub, d.str()));
  EXPECT_EQ(find(r, "model.safetensors").attempts, 3);
  EXPECT_EQ(read_file(d / "model.safetensors"), hub.files["model.safetensors"].served);

  hub.files["model.safetensors"].fail_503_times = 10;
  TempDir d2;
  try {
    download_repo(options(hub, d2.str()));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("failed after 4 attempts"), std::string::npos) << e.what();
  }
}

TEST(Download, NotFoundIsAClearError) {
  FakeHub hub;
  add(hub, "config.json", "{}", false);
  TempDir d;
  DownloadOptions o = options(hub, d.str());
  o.repo = "owner/missing";
  try {
    download_repo(o);
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("owner/missing"), std::string::npos) << m;
    EXPECT_NE(m.find("HTTP 404"), std::string::npos) << m;
  }
  o.repo = "owner/name";
  o.files = {"config.json", "no-such-file.bin"};
  try {
    download_repo(o);
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("no-such-file.bin: not found (HTTP 404)"), std::string::npos) << m;
  }
  EXPECT_EQ(hub.requests("no-such-file.bin"), 0u);  // 404 is final: no retries (the fake hub does not count it)
}

TEST(Download, IncludeFilterAndUnsafePaths) {
  FakeHub hub;
  add(hub, "config.json", "{}", false);
  add(hub, "model.safetensors", random_bytes(1000, 9), true);
  add(hub, "original/consolidated.pth", "x", false);
  TempDir d;
  DownloadOptions o = options(hub, d.str());
  o.include = {"*.json", "*.safetensors"};
  DownloadReport r = download_repo(o);
  EXPECT_EQ(r.files.size(), 2u);
  EXPECT_FALSE(fs::exists(d / "original"));
  o.include.clear();
  o.files = {"../escape.txt"};
  EXPECT_THROW(download_repo(o), Error);
}

TEST(Download, CliExitCode) {
  std::string bin = std::string(MOESRV_BINARY_DIR) + "/moesrv";
  if (!fs::exists(bin)) GTEST_SKIP() << "moesrv binary not built";
  FakeHub hub;
  add(hub, "config.json", "{}", false);
  TempDir d;
  std::string cmd = bin + " download --repo owner/name --endpoint " + hub.endpoint() + " --dir " + d.str();
  EXPECT_EQ(std::system((cmd + " >/dev/null 2>&1").c_str()), 0);
  EXPECT_EQ(read_file(d / "config.json"), "{}");
  EXPECT_NE(std::system((cmd + " --files nope.json >/dev/null 2>&1").c_str()), 0);
}
