#include <gtest/gtest.h>

#include <filesystem>

#include "format/lock.h"
#include "test_lock_helpers.h"
#include "util/error.h"

using namespace moesrv;
using namespace moesrv::testutil;

namespace {

const std::string kTiny = std::string(MOESRV_TESTDATA) + "/hf-tiny/glm_moe_dsa";

bool has_issue(const VerifyReport& r, const std::string& path, FileProblem p) {
  for (const auto& i : r.issues)
    if (i.path == path && i.problem == p) return true;
  return false;
}

VerifyOptions quiet() {
  VerifyOptions o;
  o.progress = false;
  o.threads = 2;
  return o;
}

}  // namespace

TEST(Lock, Sha256KnownVector) {
  TempDir d;
  write_file(d / "abc", "abc");
  EXPECT_EQ(sha256_file(d / "abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  write_file(d / "empty", "");
  EXPECT_EQ(sha256_file(d / "empty"), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Lock, WritesEveryFileAndSkipsTransientOnes) {
  TempDir d;
  copy_package(kTiny, d.str());
  write_file(d / "tokenizer/tokenizer.json", "{}");
  write_file(d / "x.safetensors.part", "partial");
  write_file(d / ".cache/huggingface/meta", "x");
  HashOptions ho;
  ho.progress = false;
  PackageLock lock = write_package_lock(d.str(), ho);
  EXPECT_TRUE(lock.files.count("config.json"));
  EXPECT_TRUE(lock.files.count("model.safetensors"));
  EXPECT_TRUE(lock.files.count("tokenizer/tokenizer.json"));
  EXPECT_FALSE(lock.files.count("x.safetensors.part"));
  EXPECT_FALSE(lock.files.count(".cache/huggingface/meta"));
  EXPECT_FALSE(lock.files.count(kLockFileName));
  EXPECT_EQ(lock.files["model.safetensors"].size, fs::file_size(d / "model.safetensors"));
  EXPECT_EQ(lock.files["config.json"].sha256, sha256_file(d / "config.json"));

  PackageLock back = read_lock(d / kLockFileName);
  ASSERT_EQ(back.files.size(), lock.files.size());
  EXPECT_EQ(back.files["model.safetensors"].sha256, lock.files["model.safetensors"].sha256);

  VerifyReport r = verify_package(d.str(), quiet());
  EXPECT_TRUE(r.ok()) << r.text();
  EXPECT_EQ(r.files_checked, lock.files.size());
  EXPECT_TRUE(r.issues.empty()) << r.text();
}

TEST(Lock, CorruptByteFailsNamingTheFile) {
  TempDir d;
  copy_package(kTiny, d.str());
  HashOptions ho;
  ho.progress = false;
  write_package_lock(d.str(), ho);
  flip_byte(d / "model.safetensors", 1000000);
  VerifyReport r = verify_package(d.str(), quiet());
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.error_count(), 1u);
  EXPECT_TRUE(has_issue(r, "model.safetensors", FileProblem::HashMismatch)) << r.text();
  EXPECT_NE(r.text().find("FAIL model.safetensors: sha256 mismatch"), std::string::npos) << r.text();
}

TEST(Lock, TruncatedMissingAndUnlistedFiles) {
  TempDir d;
  copy_package(kTiny, d.str());
  HashOptions ho;
  ho.progress = false;
  write_package_lock(d.str(), ho);
  uint64_t full = fs::file_size(d / "model.safetensors");
  fs::resize_file(d / "model.safetensors", full - 10);
  fs::remove(d / "generation_config.json");
  write_file(d / "extra.bin", "new");
  write_file(d / "config.json", read_file(d / "config.json") + " ");  // one byte longer

  VerifyReport r = verify_package(d.str(), quiet());
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(has_issue(r, "model.safetensors", FileProblem::Truncated)) << r.text();
  EXPECT_TRUE(has_issue(r, "generation_config.json", FileProblem::Missing)) << r.text();
  EXPECT_TRUE(has_issue(r, "config.json", FileProblem::Oversized)) << r.text();
  EXPECT_TRUE(has_issue(r, "extra.bin", FileProblem::NotInLock)) << r.text();
  EXPECT_EQ(r.error_count(), 3u);
  // The truncated shard is reported from its size alone: nothing but reference.safetensors was hashed.
  EXPECT_EQ(r.bytes_hashed, fs::file_size(d / "reference.safetensors"));
  std::string t = r.text();
  EXPECT_NE(t.find("model.safetensors: truncated (" + std::to_string(full - 10) + " of " + std::to_string(full)), std::string::npos) << t;
}

TEST(Lock, UnlistedFileAloneIsOnlyAWarning) {
  TempDir d;
  write_file(d / "config.json", "{}");
  HashOptions ho;
  ho.progress = false;
  write_package_lock(d.str(), ho);
  write_file(d / "new.txt", "x");
  VerifyReport r = verify_package(d.str(), quiet());
  EXPECT_TRUE(r.ok()) << r.text();
  EXPECT_TRUE(has_issue(r, "new.txt", FileProblem::NotInLock));
}

TEST(Lock, NoLockIsAClearError) {
  TempDir d;
  write_file(d / "config.json", "{}");
  try {
    verify_package(d.str(), quiet());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("moesrv lock"), std::string::npos) << e.what();
  }
}

TEST(Lock, MalformedLockIsRejected) {
  TempDir d;
  write_file(d / kLockFileName, R"({"version":1,"files":{"a":{"size":1,"sha256":"zz"}}})");
  EXPECT_THROW(read_lock(d / kLockFileName), Error);
}

TEST(Lock, CliExitCodes) {
  TempDir d;
  copy_package(kTiny, d.str());
  std::string bin = std::string(MOESRV_BINARY_DIR) + "/moesrv";
  if (!fs::exists(bin)) GTEST_SKIP() << "moesrv binary not built";
  std::string q = " >" + (d / "out.txt") + " 2>&1";
  ASSERT_EQ(std::system((bin + " lock --model " + d.str() + q).c_str()), 0) << read_file(d / "out.txt");
  EXPECT_EQ(std::system((bin + " verify --model " + d.str() + q).c_str()), 0) << read_file(d / "out.txt");
  flip_byte(d / "config.json", 3);
  EXPECT_NE(std::system((bin + " verify --model " + d.str() + q).c_str()), 0);
  EXPECT_NE(read_file(d / "out.txt").find("config.json: sha256 mismatch"), std::string::npos) << read_file(d / "out.txt");
}
