// Helper for keys_layout_test: prints the keys of a fixed request for the checkpoint in argv[1], so
// the test can compare keys computed by two separate processes.
#include <cstdio>
#include <vector>

#include <fmt/format.h>

#include "terrace/keys.h"
#include "terrace/kv_layout.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: kv_keys_print CHECKPOINT_DIR TENANT\n");
    return 2;
  }
  auto ckpt = terrace::model::OpenCheckpoint(argv[1]);
  if (!ckpt.ok()) {
    std::fprintf(stderr, "%s\n", ckpt.status().ToString().c_str());
    return 1;
  }
  auto layout = terrace::kv::KvLayout::FromConfig(ckpt->config, {.chunk_tokens = 16});
  if (!layout.ok()) return 1;
  const auto model_id = terrace::keys::ModelId(ckpt->config, *ckpt->weights);
  const auto ns = terrace::keys::Namespace(model_id, layout->Id(), layout->kv_codec().Name(), terrace::keys::kKeySchemaVersion);
  const auto root = terrace::keys::NamespaceRoot(model_id, layout->Id(), layout->kv_codec().Name(),
                                                 terrace::keys::kKeySchemaVersion);
  std::vector<std::int32_t> tokens(40);
  for (int i = 0; i < 40; ++i) tokens[static_cast<std::size_t>(i)] = (i * 37 + 5) % 512;
  fmt::print("model {:016x}{:016x}\n", model_id.hi, model_id.lo);
  for (const auto& id : terrace::keys::ChunkIds(root, argv[2], tokens, 16)) {
    fmt::print("{}\n", terrace::keys::KvChunkKey(ns, id).ToString());
    fmt::print("{}\n", terrace::keys::StateKey(ns, 2, id).ToString());
  }
  fmt::print("{}\n", terrace::keys::ExpertKey(ns, root, 5, 13).ToString());
  return 0;
}
