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
void RegisterRef(CLI::App& app, Runner* run);     // terrace ref kda|mla|attnres|moe|mxfp4|codec
void RegisterVerify(CLI::App& app, Runner* run);  // terrace verify kv
void RegisterPlan(CLI::App& app, Runner* run);    // terrace plan (docs/plan.md)
void RegisterTrace(CLI::App& app, Runner* run);   // terrace trace gen
void RegisterReport(CLI::App& app, Runner* run);  // terrace report RUN.json -o report.html
// Adds `run` under the `model` command (defined in cmd_model_run.cpp; called by RegisterModel).
void RegisterModelRun(CLI::App* model_cmd, Runner* run);
// Adds `codec` under the `ref` command (cmd_ref_codec.cpp; called by RegisterRef).
void RegisterRefCodec(CLI::App* ref_cmd, Runner* run);
// Adds `kv` under the `bench` command (cmd_bench_kv.cpp; called by RegisterBench).
void RegisterBenchKv(CLI::App* bench, Runner* run);
// Adds `experts` under the `bench` command (cmd_bench_experts.cpp; called by RegisterBench).
void RegisterBenchExperts(CLI::App* bench_cmd, Runner* run);
// Adds `store` under the `bench` command (cmd_bench_store.cpp; called by RegisterBench).
void RegisterBenchStore(CLI::App* bench, Runner* run);

// Exit codes, the rule for every command:
//   0  success;
//   1  runtime failure: the arguments were acceptable but the work failed (I/O error, corrupt data,
//      a store or model that does not open, out of space). Return Fail(message).
//   2  usage error: the command line itself is wrong (unknown command or flag, a value out of
//      range, a missing or conflicting flag, a path of the wrong kind given to a flag, e.g. a FIFO
//      to an input flag or a directory to an output flag). Return FailUsage(message). CLI11 parse
//      errors (including the range checks of AddIntOption/AddSizeOption) exit 2 from main.
// Never 134/139: main turns an exception that escapes a command (or any thread) into one line
// "terrace: error: ..." and exit 1. Messages name CLI flags (--capacity), not API fields.
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// Prints "terrace: error: <message>" to stderr and returns kExitFailure (1).
int Fail(std::string_view message);
// Prints "terrace: error: <message>" to stderr and returns kExitUsage (2).
int FailUsage(std::string_view message);

}  // namespace terrace::cli
