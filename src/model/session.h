// Forwarding header: Session moved to the public terrace/model.h (docs/model.md, "Public API").
#pragma once

#include "src/model/model.h"
#include "terrace/model.h"
