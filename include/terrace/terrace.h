// Umbrella include for the store API, what terrace::terrace links: blocks and ids (block.h,
// hash.h), the Store and its options, futures, stats, status and tiers (log.h comes with
// options.h). Not included here, each included on its own where used:
//   terrace/asio.h          the Boost.Asio bindings (needs Boost)
//   terrace/codec.h         block codecs (terrace::codec, find_package COMPONENTS codec)
//   terrace/model*.h        the reference model (terrace::model, COMPONENTS model)
//   terrace/keys.h, kv_layout.h, prefix_cache.h
//                           the key schema, KV block layout and prefix cache (terrace::kv, COMPONENTS kv)
//   terrace/experts.h       expert offload (terrace::experts, COMPONENTS experts)
// (docs/architecture.md, "Libraries"; kv and experts need terrace::model: TERRACE_BUILD_MODEL)
#pragma once

#include "terrace/block.h"
#include "terrace/future.h"
#include "terrace/hash.h"
#include "terrace/options.h"
#include "terrace/stats.h"
#include "terrace/status.h"
#include "terrace/store.h"
#include "terrace/tier.h"
