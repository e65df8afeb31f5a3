// Placeholder: 'terrace ref' is implemented by its own change.
#include "src/cli/command.h"

namespace terrace::cli {

void RegisterRef(CLI::App& app, Runner* run) {
  auto* cmd = app.add_subcommand("ref", "(not implemented yet)");
  cmd->callback([run] { *run = [] { return Fail("'ref' is not implemented yet"); }; });
}

}  // namespace terrace::cli
