// Placeholder: 'terrace store' is implemented by its own change.
#include "src/cli/command.h"

namespace terrace::cli {

void RegisterStore(CLI::App& app, Runner* run) {
  auto* cmd = app.add_subcommand("store", "(not implemented yet)");
  cmd->callback([run] { *run = [] { return Fail("'store' is not implemented yet"); }; });
}

}  // namespace terrace::cli
