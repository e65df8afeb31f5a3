// libFuzzer target for the Mooncake trace parser (src/plan/trace.h): any input must yield a trace or
// an InvalidArgument whose message starts with "fuzz:" and a line number, never a crash, hang or
// sanitizer report. On success every request round-trips through FormatTraceLine and the timestamps
// do not decrease.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "src/plan/trace.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace terrace::plan;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto t = ParseTrace(text, "fuzz");
  if (!t.ok()) {
    if (t.status().code() != terrace::Code::kInvalidArgument) __builtin_trap();
    if (t.status().message().rfind("fuzz:", 0) != 0) __builtin_trap();
    return 0;
  }
  std::uint64_t last = 0;
  for (const TraceRequest& r : t->requests) {
    if (r.timestamp_ms < last) __builtin_trap();
    last = r.timestamp_ms;
    auto again = ParseTraceLine(FormatTraceLine(r), "round", 1);
    if (!again.ok() || again->hash_ids != r.hash_ids || again->input_length != r.input_length ||
        again->output_length != r.output_length || again->timestamp_ms != r.timestamp_ms) {
      __builtin_trap();
    }
  }
  (void)ComputePrefixCeiling(*t, 1);
  return 0;
}
