// Each subcommand of the `moesrv` CLI lives in its own file and registers itself here.
#pragma once
#include <CLI/CLI.hpp>

namespace moesrv::cli {

void add_generate_command(CLI::App& app);

}  // namespace moesrv::cli
