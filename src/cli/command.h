// How the `terrace` tool is put together: each top-level command lives in its own cmd_*.cpp and
// exposes one Register function, called from main.cpp. A command's CLI11 callback stores the work
// to run in *run; main runs it after parsing and exits with its return value.
#pragma once

#include <functional>
#include <string_view>

#include <CLI/CLI.hpp>

namespace terrace::cli {

using Runner = std::function<int()>;

void RegisterDemo(CLI::App& app, Runner* run);    // terrace demo
void RegisterBench(CLI::App& app, Runner* run);   // terrace bench ...
void RegisterStore(CLI::App& app, Runner* run);   // terrace store fill|check
void RegisterModel(CLI::App& app, Runner* run);   // terrace model init|inspect|run
void RegisterRef(CLI::App& app, Runner* run);     // terrace ref kda|mla|attnres|moe|mxfp4
// Adds `run` under the `model` command (defined in cmd_model_run.cpp; called by RegisterModel).
void RegisterModelRun(CLI::App* model_cmd, Runner* run);

// Prints "terrace: error: <message>" to stderr and returns the exit code for a failed command (1).
int Fail(std::string_view message);

}  // namespace terrace::cli
