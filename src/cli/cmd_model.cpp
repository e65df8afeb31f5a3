// Placeholder: 'terrace model' is implemented by its own change.
#include "src/cli/command.h"

namespace terrace::cli {

void RegisterModel(CLI::App& app, Runner* run) {
  auto* cmd = app.add_subcommand("model", "(not implemented yet)");
  cmd->callback([run] { *run = [] { return Fail("'model' is not implemented yet"); }; });
}

}  // namespace terrace::cli
