// Runs the official `openai` Node client against a test server: the package scripts/setup.sh installed
// (third_party/node_openai), else installed once per build tree (`npm install openai@4`). Tests skip when node/npm
// or the package is unavailable (e.g. offline) — and fail instead under MOESRV_REQUIRE_E2E=1, as in CI.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace moesrv::testing {

inline std::string run_command(const std::string& cmd, int* rc) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return *rc = -1, out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  *rc = pclose(p);
  return out;
}

// Directory whose node_modules holds `openai`; empty when that is impossible.
inline std::string openai_node_dir() {
  int rc = 0;
  run_command("command -v node >/dev/null && command -v npm >/dev/null", &rc);
  if (rc != 0) return "";
  const std::filesystem::path installed = std::filesystem::path(MOESRV_SOURCE_DIR) / "third_party" / "node_openai";
  if (std::filesystem::exists(installed / "node_modules" / "openai" / "package.json")) return installed.string();
  std::filesystem::path dir = std::filesystem::path(MOESRV_BINARY_DIR) / "node_openai";
  if (!std::filesystem::exists(dir / "node_modules" / "openai" / "package.json")) {
    std::filesystem::create_directories(dir);
    run_command(
        "cd '" + dir.string() + "' && timeout 240 npm install --no-audit --no-fund --silent openai@4 >npm.log 2>&1",
        &rc);
    if (rc != 0) return "";
  }
  return dir.string();
}

// CI sets MOESRV_REQUIRE_E2E=1: a missing tokenizer, model or Node client is then a failure, never a silent skip.
inline bool e2e_required() {
  const char* v = std::getenv("MOESRV_REQUIRE_E2E");
  return v && std::string(v) == "1";
}

}  // namespace moesrv::testing

// Skips the test for a missing external input, or fails it when MOESRV_REQUIRE_E2E=1.
#define MOESRV_E2E_SKIP(reason)                                                        \
  do {                                                                                 \
    if (::moesrv::testing::e2e_required()) FAIL() << "MOESRV_REQUIRE_E2E: " << reason; \
    GTEST_SKIP() << reason;                                                            \
  } while (0)
