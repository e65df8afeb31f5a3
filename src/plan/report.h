// `terrace report`: turns a run's JSON (`terrace plan`, `demo`, `bench experts`, `bench kv`, `verify kv` --json,
// recognised by shape; any other JSON as a table of its
// values) into one self-contained HTML page with inline SVG charts: no scripts, no network. Pure;
// thread-safe.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/status.h"

namespace terrace::plan {

struct ReportChart {
  std::string name;  // file-name safe: "memory-vs-context", "hit-rate-vs-capacity", "tier-hit-rates"
  std::string svg;
};

struct Report {
  std::string title;
  std::string html;
  std::vector<ReportChart> charts;  // also inlined in html
};

// InvalidArgument naming `source` when the text is not a JSON object.
Result<Report> RenderReport(std::string_view json_text, std::string_view source);

// Every name a ReportChart of RenderReport can have (RenderReport fails with Internal on a chart
// missing here): `terrace report` finds an earlier report's chart files by them.
std::span<const std::string_view> ReportChartNames();

}  // namespace terrace::plan
