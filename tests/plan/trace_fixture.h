// The plan tests' fixture trace: the first 200 requests of a public Mooncake trace
// (tests/plan/data/mooncake_head200.jsonl), parsed. PLAN_TEST_DATA is set by tests/plan/CMakeLists.txt.
#pragma once

#include <fstream>
#include <sstream>
#include <string>

#include <catch2/catch.hpp>

#include "src/plan/trace.h"

namespace terrace::plan::testing {

inline Trace MooncakeHead200() {
  std::ifstream in(std::string(PLAN_TEST_DATA) + "/mooncake_head200.jsonl");
  std::stringstream ss;
  ss << in.rdbuf();
  auto t = ParseTrace(ss.str(), "fixture");
  REQUIRE(t.ok());
  return *t;
}

}  // namespace terrace::plan::testing
