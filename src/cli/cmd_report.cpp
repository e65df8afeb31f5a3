// `terrace report RUN.json -o report.html [--svg]`: a self-contained HTML page (inline SVG charts,
// no scripts, no network) from a run's JSON; docs/plan.md, "Reports".
#include <filesystem>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "src/cli/command.h"
#include "src/cli/safe_files.h"
#include "src/plan/report.h"

namespace terrace::cli {
namespace {

constexpr std::uint64_t kMaxRunJsonBytes = 256ull << 20;

struct ReportArgs {
  std::string in, out;
  bool svg = false;
};

int RunReport(const ReportArgs& a) {
  auto text = ReadInputFile(a.in, "RUN.json", kMaxRunJsonBytes);
  if (!text.ok()) return text.status().IsIoError() ? Fail(text.status().ToString()) : FailUsage(text.status().message());
  auto report = plan::RenderReport(*text, a.in);
  if (!report.ok()) return FailUsage(report.status().message());
  const std::filesystem::path out(a.out);
  std::vector<std::pair<std::filesystem::path, std::string>> files{{out, report->html}};
  if (a.svg) {
    for (const plan::ReportChart& c : report->charts) {
      files.emplace_back(out.parent_path() / (out.stem().string() + "-" + c.name + ".svg"), c.svg);
    }
  }
  for (const auto& [path, content] : files) {
    if (Status s = CheckOutputFile(path, "-o"); !s.ok()) return FailUsage(s.message());
  }
  for (const auto& [path, content] : files) {
    if (Status s = WriteOutputFile(path, "-o", content); !s.ok()) return Fail(s.ToString());
    fmt::print("wrote {}\n", path.string());
  }
  return 0;
}

}  // namespace

void RegisterReport(CLI::App& app, Runner* run) {
  auto a = std::make_shared<ReportArgs>();
  auto* c = app.add_subcommand("report", "Self-contained HTML report (inline SVG charts) from a --json run, e.g. terrace plan --json");
  c->add_option("RUN.json", a->in, "JSON output of a Terrace command")->required();
  c->add_option("-o,--out", a->out, "HTML file to write")->required();
  c->add_flag("--svg", a->svg, "Also write each chart as OUT-<chart>.svg next to the HTML");
  c->callback([run, a] { *run = [a] { return RunReport(*a); }; });
}

}  // namespace terrace::cli
