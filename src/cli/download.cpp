// `moesrv download`: fetch a model repo from a Hugging Face-style endpoint, resumable and verified.
#include <fmt/format.h>

#include "cli/commands.h"
#include "tools/download.h"
#include "util/error.h"

namespace moesrv::cli {

void add_download_command(CLI::App& app) {
  auto opt = std::make_shared<DownloadOptions>();
  auto* cmd = app.add_subcommand("download", "Download a model repository (resumable, SHA-256 verified)");
  cmd->add_option("--repo", opt->repo, "Repository, owner/name")->required();
  cmd->add_option("--revision", opt->revision, "Branch, tag or commit")->capture_default_str();
  cmd->add_option("--endpoint", opt->endpoint, "Hub endpoint (or a mirror)")->capture_default_str();
  cmd->add_option("--dir", opt->dir, "Destination directory")->required();
  cmd->add_option("--token", opt->token, "Access token (default: $HF_TOKEN)");
  cmd->add_option("--files", opt->files, "Download only these files (skips the API listing)");
  cmd->add_option("--include", opt->include, "Glob patterns filtering the listed files, e.g. '*.json' '*.safetensors'");
  cmd->add_option("--lock", opt->lock_file, "A checkpoint.lock.json to verify every file against");
  cmd->add_option("--retries", opt->max_attempts, "Attempts per file")->capture_default_str();
  cmd->callback([opt] {
    DownloadReport rep = download_repo(*opt);
    fmt::print("{}", rep.text());
    size_t unverified = 0;
    for (const auto& f : rep.files) unverified += !f.verified;
    if (unverified)
      fmt::print("note: {} file(s) had no reference hash (not in a lock, not LFS); run `moesrv lock` after checking them\n", unverified);
  });
}

}  // namespace moesrv::cli
