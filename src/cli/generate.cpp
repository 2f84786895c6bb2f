#include "cli/commands.h"
#include "util/error.h"

namespace moesrv::cli {

void add_generate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Greedy/sampled generation from token ids");
  cmd->callback([] { fail("generate: not implemented yet"); });
}

}  // namespace moesrv::cli
