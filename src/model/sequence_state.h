// Forwarding header: the declarations moved to the public terrace/model_state.h (see docs/model.md,
// "Public API").
#pragma once

#include "terrace/model_state.h"
