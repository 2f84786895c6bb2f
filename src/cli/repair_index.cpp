// `moesrv repair-index`: add unindexed tensors/shards to model.safetensors.index.json, re-lock if shards verify.
#include <fmt/format.h>

#include "cli/commands.h"
#include "format/index_repair.h"
#include "util/error.h"

namespace moesrv::cli {

void add_repair_index_command(CLI::App& app) {
  struct Args {
    std::string dir;
    bool dry_run = false, allow_unverified = false;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("repair-index", "Add tensors/shards missing from model.safetensors.index.json");
  cmd->add_option("--model", args->dir, "Model directory")->required();
  cmd->add_flag("--dry-run", args->dry_run, "Report what would change; write nothing");
  cmd->add_flag("--allow-unverified", args->allow_unverified,
                "Write the index even when shards fail checkpoint.lock.json (the lock is left untouched)");
  cmd->callback([args] {
    RepairOptions opt;
    opt.dry_run = args->dry_run;
    opt.require_lock_ok = !args->allow_unverified;
    RepairReport rep = repair_index(args->dir, opt);
    fmt::print("{}", rep.text());
    if (args->dry_run) return;
    // The config may need tensors that no shard holds at all (e.g. DSA indexer weights).
    auto pkg = ModelPackage::open(args->dir);
    auto missing = package_missing_tensors(*pkg, required_indexer_tensors(pkg->config()));
    if (!missing.empty()) {
      for (const auto& m : missing) fmt::print("MISSING {}\n", m);
      fail("{}: {} tensor(s) the config needs (DSA indexer) are in no shard; the package is incomplete", args->dir,
           missing.size());
    }
  });
}

}  // namespace moesrv::cli
