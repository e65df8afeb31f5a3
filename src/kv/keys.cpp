#include "terrace/keys.h"

#include <algorithm>
#include <string>
#include <vector>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "terrace/hash.h"

namespace terrace::keys {
namespace {

void PutLe(std::string* out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void Update(XXH3_state_t* s, const std::string& bytes) { XXH3_128bits_update(s, bytes.data(), bytes.size()); }

}  // namespace

ContentId ModelId(const model::ModelConfig& config, const model::WeightSource& weights) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_128bits_reset(&state);
  std::string head = "terrace-model-id-v1";
  const std::string json = model::ToConfigJson(config);
  PutLe(&head, json.size(), 8);
  head += json;
  Update(&state, head);
  std::vector<std::string> names = weights.Names();
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    auto view = weights.Get(name);
    std::string meta;
    PutLe(&meta, name.size(), 8);
    meta += name;
    if (!view.ok()) {
      // A listed tensor that cannot be read still changes the id (and the model will not load).
      meta += "<unreadable>";
      Update(&state, meta);
      continue;
    }
    const std::string_view dt = model::DTypeName(view->dtype);
    PutLe(&meta, dt.size(), 8);
    meta += dt;
    PutLe(&meta, view->shape.size(), 8);
    for (std::int64_t d : view->shape) PutLe(&meta, static_cast<std::uint64_t>(d), 8);
    PutLe(&meta, view->data.size(), 8);
    Update(&state, meta);
    XXH3_128bits_update(&state, view->data.data(), view->data.size());
  }
  const XXH128_hash_t h = XXH3_128bits_digest(&state);
  return ContentId{h.high64, h.low64};
}

namespace {
// The bytes a namespace and its root hash (docs/keys.md).
std::string NamespaceBytes(const ContentId& model_id, std::string_view layout, std::string_view codec,
                           std::uint32_t version) {
  std::string buf = "terrace-keys-v1";
  PutLe(&buf, model_id.hi, 8);
  PutLe(&buf, model_id.lo, 8);
  PutLe(&buf, layout.size(), 8);
  buf.append(layout);
  PutLe(&buf, codec.size(), 8);
  buf.append(codec);
  PutLe(&buf, version, 4);
  return buf;
}
}  // namespace

std::uint32_t Namespace(const ContentId& model_id, std::string_view layout, std::string_view codec,
                        std::uint32_t version) {
  const std::string buf = NamespaceBytes(model_id, layout, codec, version);
  return static_cast<std::uint32_t>(XXH3_64bits(buf.data(), buf.size()) & 0xffffffffu);
}

ContentId NamespaceRoot(const ContentId& model_id, std::string_view layout, std::string_view codec,
                        std::uint32_t version) {
  const std::string buf = NamespaceBytes(model_id, layout, codec, version);
  return HashBytes(std::as_bytes(std::span(buf.data(), buf.size())));
}

ContentId TenantRoot(const ContentId& namespace_root, std::string_view tenant) {
  std::string buf = "terrace-tenant-v1";
  buf.append(tenant);
  const ContentId t = HashBytes(std::as_bytes(std::span(buf.data(), buf.size())));
  const std::int32_t salt[4] = {static_cast<std::int32_t>(t.hi >> 32), static_cast<std::int32_t>(t.hi & 0xffffffffu),
                                static_cast<std::int32_t>(t.lo >> 32), static_cast<std::int32_t>(t.lo & 0xffffffffu)};
  return ChainContentId(namespace_root, salt);
}

std::vector<ContentId> ChunkIds(const ContentId& namespace_root, std::string_view tenant,
                                std::span<const std::int32_t> tokens, int chunk_tokens) {
  std::vector<ContentId> ids;
  if (chunk_tokens <= 0) return ids;
  const std::size_t c = static_cast<std::size_t>(chunk_tokens);
  ids.reserve(tokens.size() / c);
  ContentId parent = TenantRoot(namespace_root, tenant);
  for (std::size_t begin = 0; begin + c <= tokens.size(); begin += c) {
    parent = ChainContentId(parent, tokens.subspan(begin, c));
    ids.push_back(parent);
  }
  return ids;
}

BlockKey KvChunkKey(std::uint32_t ns, const ContentId& chunk_id) {
  return BlockKey{ns, BlockKind::kKv, 0, chunk_id};
}

BlockKey StateKey(std::uint32_t ns, int layer, const ContentId& boundary_id) {
  return BlockKey{ns, BlockKind::kState, static_cast<std::uint32_t>(layer), boundary_id};
}

BlockKey ExpertKey(std::uint32_t ns, const ContentId& namespace_root, int layer, int expert) {
  const std::int32_t which[2] = {layer, expert};
  return BlockKey{ns, BlockKind::kExpert, static_cast<std::uint32_t>(layer), ChainContentId(namespace_root, which)};
}

}  // namespace terrace::keys
