// Spec validation shared by Encode (InvalidArgument) and Decode (Corruption of a header).
#pragma once

#include <string>

#include "terrace/codec.h"

namespace terrace::codec::detail {

// Empty when (kind, scales, group, lossless) is a combination CodecSpec::Parse can produce;
// otherwise what is wrong, in words.
std::string SpecProblem(CodecKind kind, ScaleMode scales, int group, Lossless lossless);

}  // namespace terrace::codec::detail
