// The marks Terrace writes into the files it produces, so that a later run can tell its own output
// from a user's file of the same name: the CLI replaces an existing output file without --force only
// when it carries the mark of its format (src/cli/safe_files.h, docs/errors.md "Output files").
// Writers and the recogniser both use these constants; changing one makes files written before
// unrecognised (they then need --force once).
#pragma once

#include <string_view>

namespace terrace {

// HTML (`terrace report`): in <head>, before <title>, within the first few hundred bytes; self-closed,
// so that the page is well-formed XML (docs/plan.md, "Reports").
inline constexpr std::string_view kHtmlGeneratorMeta = "<meta name=\"generator\" content=\"terrace\"/>";
// The same mark as Terrace wrote it before it was self-closed: still recognised, never written.
inline constexpr std::string_view kHtmlGeneratorMetaOld = "<meta name=\"generator\" content=\"terrace\">";
// SVG charts: an XML comment straight after the opening <svg ...> tag.
inline constexpr std::string_view kSvgGeneratorComment = "<!-- generator: terrace -->";
// safetensors: an entry of the header's "__metadata__" string map, written by SafetensorsWriter.
inline constexpr std::string_view kSafetensorsGeneratorKey = "generator";
inline constexpr std::string_view kSafetensorsGeneratorValue = "terrace";
// A model checkpoint Terrace writes (`model init`, the demo's model; src/model/weights_init.cpp) has
// this "__metadata__" entry, its weights' seed, in each of its safetensors files, as every version
// has written it; no other file Terrace writes has it. The mark above says Terrace wrote the file,
// this one that it is a model, not an output: the CLI's output flags replace it only with --force.
inline constexpr std::string_view kSafetensorsCheckpointKey = "terrace_seed";
// Prometheus text (`--expert-prometheus`): the first line, a comment scrapers ignore.
inline constexpr std::string_view kPrometheusGeneratorLine = "# generator: terrace";
// demo-run.json (`terrace demo`): the JSON object's first member, "generator": "terrace" (any
// whitespace around the tokens; src/cli/demo_dir.h writes and recognises it).
inline constexpr std::string_view kJsonGeneratorKey = "generator";
inline constexpr std::string_view kJsonGeneratorValue = "terrace";
// PNG charts (`terrace report --png`): a tEXt chunk straight after IHDR whose data is this keyword,
// a NUL, and this text (PNG's registered "Software" keyword).
inline constexpr std::string_view kPngGeneratorKeyword = "Software";
inline constexpr std::string_view kPngGeneratorText = "terrace";

}  // namespace terrace
