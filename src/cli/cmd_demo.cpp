// Placeholder: 'terrace demo' is implemented by its own change.
#include "src/cli/command.h"

namespace terrace::cli {

void RegisterDemo(CLI::App& app, Runner* run) {
  auto* cmd = app.add_subcommand("demo", "(not implemented yet)");
  cmd->callback([run] { *run = [] { return Fail("'demo' is not implemented yet"); }; });
}

}  // namespace terrace::cli
