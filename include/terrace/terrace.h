// Umbrella include: the whole public API except the Boost.Asio bindings (terrace/asio.h).
#pragma once

#include "terrace/block.h"
#include "terrace/future.h"
#include "terrace/hash.h"
#include "terrace/options.h"
#include "terrace/stats.h"
#include "terrace/status.h"
#include "terrace/store.h"
#include "terrace/tier.h"
