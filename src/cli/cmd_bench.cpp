// Placeholder: 'terrace bench' is implemented by its own change.
#include "src/cli/command.h"

namespace terrace::cli {

void RegisterBench(CLI::App& app, Runner* run) {
  auto* cmd = app.add_subcommand("bench", "(not implemented yet)");
  cmd->callback([run] { *run = [] { return Fail("'bench' is not implemented yet"); }; });
}

}  // namespace terrace::cli
