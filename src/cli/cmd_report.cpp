// `terrace report RUN.json -o report.html [--svg] [--png] [--force]`: a self-contained HTML page
// (inline SVG charts, no scripts, no network) from a run's JSON; --svg and --png also write each chart
// as a file next to it (PNG rasterised by rsvg-convert, Debian's librsvg2-bin); docs/plan.md,
// "Reports". An existing output file is replaced only when Terrace wrote it or with --force.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "src/cli/command.h"
#include "src/cli/safe_files.h"
#include "src/common/generator_mark.h"
#include "src/plan/report.h"

namespace terrace::cli {
namespace {

constexpr std::uint64_t kMaxRunJsonBytes = 256ull << 20;

struct ReportArgs {
  std::string in, out;
  bool svg = false, png = false, force = false;
};

constexpr const char* kRasteriser = "rsvg-convert";

// The rasteriser's path on $PATH; empty when it is not installed.
std::string FindOnPath(std::string_view name) {
  const char* path = std::getenv("PATH");
  std::string_view rest = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  while (!rest.empty()) {
    const std::size_t colon = rest.find(':');
    const std::string_view dir = rest.substr(0, colon);
    rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
    if (dir.empty()) continue;
    const std::string candidate = fmt::format("{}/{}", dir, name);
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// `svg` rasterised to PNG bytes by rsvg-convert: the SVG goes in on its stdin, the PNG comes back on
// its stdout (so the output file is written by WriteOutputFile, with its rules, not by the tool).
Result<std::string> RasterisePng(const std::string& tool, std::string_view svg, std::string_view what) {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) return Status::IoError(fmt::format("pipe: {}", std::strerror(errno)));
  if (::pipe2(out, O_CLOEXEC) != 0) {
    ::close(in[0]);
    ::close(in[1]);
    return Status::IoError(fmt::format("pipe: {}", std::strerror(errno)));
  }
  std::string a0 = tool, a1 = "--format=png";
  char* argv[] = {a0.data(), a1.data(), nullptr};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&fa, out[1], STDOUT_FILENO);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, tool.c_str(), &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(in[0]);
  ::close(out[1]);
  if (rc != 0) {
    ::close(in[1]);
    ::close(out[0]);
    return Status::IoError(fmt::format("--png: cannot start {}: {}", tool, std::strerror(rc)));
  }
  // rsvg-convert reads all of stdin before it writes anything, so writing the whole SVG first and
  // reading the PNG after cannot deadlock on full pipes.
  bool write_failed = false;
  // A tool that exits early must fail the write (EPIPE), not kill this process with SIGPIPE.
  struct sigaction ignore {}, previous {};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, &previous);
  for (std::size_t done = 0; done < svg.size();) {
    const ssize_t n = ::write(in[1], svg.data() + done, svg.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      write_failed = true;
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  ::close(in[1]);
  ::sigaction(SIGPIPE, &previous, nullptr);
  std::string png;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(out[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    png.append(buf, static_cast<std::size_t>(n));
  }
  ::close(out[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  // A PNG starts with its 8-byte signature and then the IHDR chunk (length, "IHDR", 13 bytes, CRC).
  const bool is_png = png.size() >= 33 && png.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0 && png.compare(12, 4, "IHDR") == 0;
  if (write_failed || !WIFEXITED(status) || WEXITSTATUS(status) != 0 || !is_png)
    return Status::IoError(fmt::format("--png: {} failed on the {} chart (exit status {})", tool, what,
                                       WIFEXITED(status) ? WEXITSTATUS(status) : -1));
  return png;
}

// The page lists the chart files it wrote beside itself, "<chart>.<svg|png>" (names from
// plan::ReportChartNames, so nothing to escape), in this meta element of its head; the next report
// to the same -o reads it to find the charts that would be left over.
constexpr std::string_view kChartsMeta = "<meta name=\"terrace-charts\" content=\"";

// The chart files (OUT-<chart>.<ext>) the Terrace-marked page at `out` says it wrote; empty when
// there is no such page (absent, not Terrace's, or from before the list).
std::vector<std::filesystem::path> ChartsOfPageAt(const std::filesystem::path& out) {
  std::vector<std::filesystem::path> charts;
  const std::optional<std::string> head = MarkedTerraceFileHead(out, OutputFormat::kHtml);
  if (!head) return charts;
  const std::size_t at = head->find(kChartsMeta);
  if (at == std::string::npos) return charts;
  const std::size_t from = at + kChartsMeta.size(), to = head->find('"', from);
  if (to == std::string::npos) return charts;
  std::istringstream names(head->substr(from, to - from));
  const auto known = plan::ReportChartNames();
  for (std::string name; names >> name;) {
    const std::filesystem::path file(name);
    const std::string chart = file.stem().string(), ext = file.extension().string();
    if ((ext != ".svg" && ext != ".png") || std::find(known.begin(), known.end(), chart) == known.end()) continue;
    charts.push_back(out.parent_path() / (out.stem().string() + "-" + chart + ext));
  }
  return charts;
}

// Removes the chart files the earlier page at `out` wrote (`earlier`, ChartsOfPageAt) that this report
// did not write (`written`): it draws fewer charts, or runs without --svg/--png. They would stand
// beside the new page as if they were its own. Only files still carrying Terrace's mark; another
// page's charts (another -o, even of the same stem) are never in that list. 1 (said) when one cannot
// be removed.
int RemoveStaleCharts(const std::filesystem::path& out, const std::vector<std::filesystem::path>& earlier,
                      const std::vector<std::filesystem::path>& written) {
  for (const std::filesystem::path& p : earlier) {
    const OutputFormat format = p.extension() == ".svg" ? OutputFormat::kSvg : OutputFormat::kPng;
    if (std::find(written.begin(), written.end(), p) != written.end() || !IsMarkedTerraceFile(p, format)) continue;
    std::error_code ec;
    if (!std::filesystem::remove(p, ec) && ec) {
      return Fail(fmt::format("cannot remove {}, a chart the earlier report {} wrote that this report does not "
                              "draw: {}; remove it by hand",
                              p.string(), out.string(), ec.message()));
    }
    fmt::print("removed {} (the earlier report's chart; this report does not write it)\n", p.string());
  }
  return 0;
}

int RunReport(const ReportArgs& a) {
  auto text = ReadInputFile(a.in, "RUN.json", kMaxRunJsonBytes);
  if (!text.ok()) return text.status().IsIoError() ? Fail(text.status().ToString()) : FailUsage(text.status().message());
  auto report = plan::RenderReport(*text, a.in);
  if (!report.ok()) return FailUsage(report.status().message());
  std::string rasteriser;
  if (a.png) {
    rasteriser = FindOnPath(kRasteriser);
    if (rasteriser.empty())
      return Fail(fmt::format("--png needs {} on PATH to rasterise the charts; install it (Debian: apt-get install "
                              "librsvg2-bin) or leave out --png (--svg writes the charts as SVG)",
                              kRasteriser));
  }
  const std::filesystem::path out(a.out);
  // Each file with the flag that asked for it and its format (its mark: safe_files.h, OutputRules).
  struct OutFile {
    std::filesystem::path path;
    std::string content;
    const char* flag;
    OutputFormat format;
  };
  const OutputRules rules{.format = OutputFormat::kHtml, .force = a.force, .inputs = {{"RUN.json", a.in}}};
  std::vector<OutFile> files{{out, report->html, "-o", OutputFormat::kHtml}};
  auto beside = [&](const plan::ReportChart& c, const char* ext) {
    return out.parent_path() / (out.stem().string() + "-" + c.name + ext);
  };
  for (const plan::ReportChart& c : report->charts) {
    if (a.svg) files.push_back({beside(c, ".svg"), c.svg, "--svg", OutputFormat::kSvg});
  }
  if (a.png) {
    for (const plan::ReportChart& c : report->charts) {
      if (Status s = CheckOutputFile(beside(c, ".png"), "--png", rules.As(OutputFormat::kPng)); !s.ok())
        return FailUsage(s.message());
    }
    for (const plan::ReportChart& c : report->charts) {
      auto png = RasterisePng(rasteriser, c.svg, c.name);
      if (!png.ok()) return Fail(png.status().message());
      files.push_back({beside(c, ".png"), WithPngMark(*png), "--png", OutputFormat::kPng});
    }
  }
  for (const OutFile& f : files) {
    if (Status s = CheckOutputFile(f.path, f.flag, rules.As(f.format)); !s.ok()) return FailUsage(s.message());
  }
  // The page records its chart files (kChartsMeta) after Terrace's mark.
  std::string listed;
  for (std::size_t i = 1; i < files.size(); ++i) {
    const std::string name = files[i].path.filename().string();
    listed += (i > 1 ? " " : "") + name.substr(out.stem().string().size() + 1);
  }
  if (const std::size_t mark = files[0].content.find(kHtmlGeneratorMeta); mark != std::string::npos) {
    files[0].content.insert(mark + kHtmlGeneratorMeta.size(), std::string(kChartsMeta) + listed + "\"/>");
  }
  const std::vector<std::filesystem::path> earlier = ChartsOfPageAt(out);
  std::vector<std::filesystem::path> written;
  for (const OutFile& f : files) {
    if (Status s = WriteOutputFile(f.path, f.flag, rules.As(f.format), f.content); !s.ok()) return Fail(s.ToString());
    fmt::print("wrote {}\n", f.path.string());
    written.push_back(f.path);
  }
  return RemoveStaleCharts(out, earlier, written);
}

}  // namespace

void RegisterReport(CLI::App& app, Runner* run) {
  auto a = std::make_shared<ReportArgs>();
  auto* c = app.add_subcommand("report", "Self-contained HTML report (inline SVG charts) from a --json run of plan, demo, bench or verify");
  c->add_option("RUN.json", a->in, "JSON output of a Terrace command")->required();
  c->add_option("-o,--out", a->out, "HTML file to write")->required();
  c->add_flag("--svg", a->svg, "Also write each chart as OUT-<chart>.svg next to the HTML");
  c->add_flag("--png", a->png, "Also write each chart as OUT-<chart>.png next to the HTML (needs rsvg-convert)");
  c->add_flag("--force", a->force,
              "Replace existing output files Terrace did not write (without it: only its own HTML, SVG and PNG "
              "files; never RUN.json itself)");
  c->callback([run, a] { *run = [a] { return RunReport(*a); }; });
}

}  // namespace terrace::cli
