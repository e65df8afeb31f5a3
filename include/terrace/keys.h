// The key schema: how every KV-chunk, KDA-state and expert block is named (docs/keys.md, "Key
// schema"). One convention for the whole project; nothing else builds BlockKeys for model data.
//
//   namespace      = low 32 bits of XXH3-64("terrace-keys-v1" | model id | layout | codec | version)
//   namespace root = XXH3-128 of the same bytes: what every content id below chains from, so two
//                    namespaces that share their 32 bits still never share a key
//   KV chunk  = {ns, kKv,     layer 0,           chunk content id (chained from the KV namespace root)}
//   KDA state = {ns, kState,  model layer (0-b), content id of the chunk ending at the boundary}
//   expert    = {ns, kExpert, model layer (0-b), ChainContentId(namespace root, {layer, expert})}
//
// Every function is pure, deterministic across processes and machines, and thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>
#include <string_view>

#include "terrace/block.h"
#include "terrace/model_config.h"
#include "terrace/model_weights.h"

namespace terrace::keys {

// Bumped when the meaning of a key changes; part of every namespace. 2: content ids chain from the
// 128-bit namespace root (1: from the 32-bit namespace).
inline constexpr std::uint32_t kKeySchemaVersion = 2;

// 128-bit identity of a model's weights + config: XXH3-128 over the canonical config JSON
// (model::ToConfigJson) followed by every tensor's name, dtype, shape and bytes, in sorted name
// order. Two processes loading the same checkpoint get the same id. Reads every tensor once.
ContentId ModelId(const model::ModelConfig& config, const model::WeightSource& weights);

// A BlockKey namespace: the low 32 bits of XXH3-64 over "terrace-keys-v1" | model id (hi, lo as
// little-endian u64) | `layout` | `codec` | version (little-endian u32); each string is preceded by
// its length as a little-endian u64 so no two (layout, codec) pairs encode alike. `layout` is a
// canonical text such as KvLayout::Id() or "experts-mxfp4-v1".
std::uint32_t Namespace(const ContentId& model_id, std::string_view layout, std::string_view codec,
                        std::uint32_t version);
// The namespace's root: XXH3-128 (seed 0) of the byte string Namespace hashes. It carries the whole
// model id into every content id, which the 32-bit namespace cannot.
ContentId NamespaceRoot(const ContentId& model_id, std::string_view layout, std::string_view codec,
                        std::uint32_t version);

// Root of a tenant's chain: ChainContentId(namespace_root, salt) where salt is the 128-bit XXH3 of
// "terrace-tenant-v1" | tenant as four int32 (hi high, hi low, lo high, lo low). The default tenant
// is "" (salted the same way), so no two tenants share a chain.
ContentId TenantRoot(const ContentId& namespace_root, std::string_view tenant);

// Content ids of the full chunks of `tokens` (tokens.size() / chunk_tokens of them): id[i] =
// ChainContentId(id[i-1], tokens of chunk i), id[-1] = TenantRoot(namespace_root, tenant).
// chunk_tokens > 0.
std::vector<ContentId> ChunkIds(const ContentId& namespace_root, std::string_view tenant,
                                std::span<const std::int32_t> tokens, int chunk_tokens);

// KV chunk (all MLA layers of one chunk in one block): kind kKv, layer 0, id = chunk content id.
BlockKey KvChunkKey(std::uint32_t ns, const ContentId& chunk_id);
// KDA snapshot of one KDA layer at the boundary whose chunk id is `boundary_id`: kind kState,
// layer = model layer index (0-based).
BlockKey StateKey(std::uint32_t ns, int layer, const ContentId& boundary_id);
// Routed expert: kind kExpert, layer = model layer (0-based), id = ChainContentId(namespace_root,
// {layer, expert}) (the root of the same namespace as `ns`).
BlockKey ExpertKey(std::uint32_t ns, const ContentId& namespace_root, int layer, int expert);

}  // namespace terrace::keys
