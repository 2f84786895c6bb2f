// `moesrv lock` and `moesrv verify`: write / check checkpoint.lock.json.
#include <fmt/format.h>

#include "cli/commands.h"
#include "format/lock.h"
#include "util/error.h"

namespace moesrv::cli {

void add_lock_verify_commands(CLI::App& app) {
  struct Args {
    std::string dir;
    int threads = 0;
    bool quiet = false;
  };
  auto args = std::make_shared<Args>();

  auto* lock = app.add_subcommand("lock", "Hash every file of a model package into checkpoint.lock.json");
  lock->add_option("--model", args->dir, "Model directory")->required();
  lock->add_option("--threads", args->threads, "Files hashed in parallel (0: auto)");
  lock->callback([args] {
    HashOptions opt;
    opt.threads = args->threads;
    PackageLock l = write_package_lock(args->dir, opt);
    uint64_t total = 0;
    for (const auto& [n, e] : l.files) total += e.size;
    fmt::print("wrote {}/{}: {} files, {:.2f} GiB\n", args->dir, kLockFileName, l.files.size(), double(total) / (1ull << 30));
  });

  auto* verify = app.add_subcommand("verify", "Check a model package against checkpoint.lock.json (size + SHA-256)");
  verify->add_option("--model", args->dir, "Model directory")->required();
  verify->add_option("--threads", args->threads, "Files hashed in parallel (0: auto)");
  verify->add_flag("-q,--quiet", args->quiet, "Print problems only");
  verify->callback([args] {
    VerifyOptions opt;
    opt.threads = args->threads;
    VerifyReport rep = verify_package(args->dir, opt);
    std::string text = rep.text();
    if (args->quiet && rep.ok()) return;
    fmt::print("{}", text);
    if (!rep.ok()) fail("{}: {} file(s) failed verification", args->dir, rep.error_count());
  });
}

}  // namespace moesrv::cli
