// Runs the official `openai` Node client against a test server: installs the package once per build tree
// (`npm install openai@4`); tests skip when node/npm or the package is unavailable (e.g. offline).
#pragma once
#include <cstdio>
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

}  // namespace moesrv::testing
