// Each subcommand of the `moesrv` CLI lives in its own file and registers itself here.
#pragma once
#include <CLI/CLI.hpp>

namespace moesrv::cli {

void add_generate_command(CLI::App& app);
void add_needle_command(CLI::App& app);
void add_lock_verify_commands(CLI::App& app);  // lock, verify
void add_repair_index_command(CLI::App& app);
void add_download_command(CLI::App& app);
void add_serve_command(CLI::App& app);
void add_preflight_command(CLI::App& app);

}  // namespace moesrv::cli
