// libFuzzer target for the model config parser (terrace::model::ParseConfigJson) and what is
// derived from a config (KvLayout): any input must yield a config or an InvalidArgument whose
// message starts with "fuzz:", never a crash, an exception, a hang or a sanitizer report (signed
// overflow in a size computed from huge dimensions included). A config that parses writes back
// (ToConfigJson) to text that parses to the same config.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "terrace/kv_layout.h"
#include "terrace/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace terrace;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto c = model::ParseConfigJson(text, "fuzz");
  if (!c.ok()) {
    if (c.status().code() != Code::kInvalidArgument || c.status().message().rfind("fuzz", 0) != 0) __builtin_trap();
    return 0;
  }
  const std::string written = model::ToConfigJson(*c);
  auto again = model::ParseConfigJson(written, "round");
  if (!again.ok() || model::ToConfigJson(*again) != written) __builtin_trap();

  // Every size the layout derives, at a small and the largest chunk: computed or refused, never UB.
  for (int chunk : {1, 65536}) {
    kv::KvLayoutOptions options;
    options.chunk_tokens = chunk;
    auto layout = kv::KvLayout::FromConfig(*c, options);
    if (!layout.ok()) {
      if (layout.status().code() != Code::kInvalidArgument) __builtin_trap();
      continue;
    }
    volatile std::uint64_t sink = layout->mla_bytes_per_token() + layout->kda_state_bytes_per_sequence() +
                                  layout->mla_chunk_block_bytes() + layout->state_block_bytes();
    (void)sink;
    if (layout->Id().empty()) __builtin_trap();
  }
  return 0;
}
