#include <cstdio>
#include <string>

#include <fmt/format.h>

#include "src/cli/command.h"

namespace terrace::cli {

int Fail(std::string_view message) {
  fmt::print(stderr, "terrace: error: {}\n", message);
  return 1;
}

}  // namespace terrace::cli

int main(int argc, char** argv) {
  using namespace terrace::cli;
  CLI::App app{"Terrace: tiered storage for LLM inference state (KV blocks, recurrent state, MoE experts)\n"
               "across GPU HBM, pinned host RAM and NVMe.",
               "terrace"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "terrace 0.1.0");
  Runner run;
  RegisterDemo(app, &run);
  RegisterBench(app, &run);
  RegisterStore(app, &run);
  RegisterModel(app, &run);
  RegisterRef(app, &run);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    if (what.empty()) what = "invalid arguments";
    fmt::print(stderr, "terrace: error: {} (run 'terrace --help' or 'terrace <command> --help')\n", what);
    return 2;
  }
  if (!run) return Fail("no command given; run 'terrace --help'");
  return run();
}
