// `moesrv preflight`: hardware, package files, parameter and KV cache sizes, and whether the model fits.
#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>

#include "cli/commands.h"
#include "tools/preflight.h"
#include "util/error.h"

namespace moesrv::cli {

void add_preflight_command(CLI::App& app) {
  struct Args {
    std::string dir;
    PreflightOptions opt;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("preflight", "Check whether a model package fits this machine (exit 2 if it does not)");
  cmd->add_option("--model", a->dir, "Model directory")->required();
  cmd->add_option("--vram-budget", a->opt.vram_budget_gib, "GiB of VRAM to use (default: free VRAM of all GPUs)");
  cmd->add_option("--assume-bpw", a->opt.assume_bits, "Config-only folder: bits per weight of the linear layers for the estimate (e.g. 3.05)");
  cmd->add_option("--ctx", a->opt.ctx, "Context length for the KV cache (default: min(max_position_embeddings, 32768))");
  cmd->add_option("--kv-bytes", a->opt.kv_dtype_bytes, "Bytes per KV cache element")->capture_default_str();
  cmd->add_option("--overhead", a->opt.overhead_gib, "GiB reserved for workspace")->capture_default_str();
  cmd->add_flag("--hash", a->opt.hash, "SHA-256 every file against the lock (slow); default checks sizes");
  cmd->add_flag("--json", a->json, "Machine-readable output");
  cmd->callback([a] {
    PreflightReport r = run_preflight(a->dir, a->opt);
    if (a->json) fmt::print("{}\n", r.to_json().dump(2));
    else fmt::print("{}", r.text());
    if (!r.lock_ok) fail("{}: package files do not match {}", a->dir, "checkpoint.lock.json");
    std::fflush(stdout);
    if (!r.fits) std::exit(2);
  });
}

}  // namespace moesrv::cli
