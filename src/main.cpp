// moesrv: MoE inference engine and OpenAI-compatible server.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "cli/commands.h"
#include "util/error.h"

int main(int argc, char** argv) {
  CLI::App app{"moesrv: run large Mixture-of-Experts models on a home machine"};
  app.require_subcommand(1);
  moesrv::cli::add_generate_command(app);
  moesrv::cli::add_needle_command(app);
  moesrv::cli::add_lock_verify_commands(app);
  moesrv::cli::add_repair_index_command(app);
  moesrv::cli::add_download_command(app);
  moesrv::cli::add_serve_command(app);
  moesrv::cli::add_preflight_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const moesrv::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
