// Telling a Status in other words, keeping what callers branch on.
#pragma once

#include <string>

#include "terrace/status.h"

namespace terrace {

// A Status of `s`'s code (and retryability) whose message is `message`: `s` told in other words.
// Precondition: !s.ok() (an OK `s` gives Internal: there is nothing to reword).
Status Reworded(const Status& s, std::string message);

}  // namespace terrace
