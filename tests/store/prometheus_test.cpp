// Prometheus text exposition: checked with a small independent parser.
#include <catch2/catch.hpp>

#include <map>
#include <regex>
#include <sstream>

#include "store_test_util.h"

namespace terrace::testing {
namespace {

struct Sample {
  std::string name, labels;
  double value;
};

// Parses the text format; fails the test on any malformed line.
std::vector<Sample> Parse(const std::string& text, std::map<std::string, std::string>* types) {
  static const std::regex kSample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*)\})? (-?[0-9.eE+-]+|\+Inf|NaN)$)");
  static const std::regex kType(R"(^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)$)");
  static const std::regex kHelp(R"(^# HELP [a-zA-Z_:][a-zA-Z0-9_:]* .+$)");
  std::vector<Sample> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    INFO("line: " << line);
    std::smatch m;
    if (line.rfind("# TYPE", 0) == 0) {
      REQUIRE(std::regex_match(line, m, kType));
      (*types)[m[1]] = m[2];
    } else if (line.rfind("# HELP", 0) == 0) {
      REQUIRE(std::regex_match(line, kHelp));
    } else {
      REQUIRE(std::regex_match(line, m, kSample));
      out.push_back({m[1], m[3], std::stod(m[5])});
    }
  }
  return out;
}

TEST_CASE("PrometheusText is valid exposition with cumulative histograms") {
  FakeTiers f(1 << 20, 1 << 20, 1 << 20);
  auto store = OpenFakeStore(f);
  for (int i = 0; i < 20; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, 1000), {Codec::kRaw, TierId::kNvme}).ok());
  for (int i = 0; i < 20; ++i) REQUIRE(GetBytes(*store, TestKey(i)).ok());
  for (int i = 0; i < 5; ++i) REQUIRE(GetBytes(*store, TestKey(i)).ok());
  std::string text = store->PrometheusText();
  std::map<std::string, std::string> types;
  auto samples = Parse(text, &types);
  REQUIRE_FALSE(samples.empty());

  // Every sample belongs to a declared family.
  for (const auto& s : samples) {
    std::string family = std::regex_replace(s.name, std::regex("_(bucket|sum|count)$"), "");
    INFO(s.name);
    CHECK((types.count(s.name) || (types.count(family) && types[family] == "histogram")));
  }
  auto value = [&](const std::string& name, const std::string& labels) {
    for (const auto& s : samples) {
      if (s.name == name && s.labels == labels) return s.value;
    }
    FAIL("missing sample " << name << "{" << labels << "}");
    return -1.0;
  };
  CHECK(value("terrace_tier_hits_total", "tier=\"host\"") == 5);
  CHECK(value("terrace_tier_hits_total", "tier=\"nvme\"") == 20);
  CHECK(value("terrace_tier_emulated", "tier=\"hbm\"") == 1);
  CHECK(value("terrace_tier_emulated", "tier=\"host\"") == 0);
  CHECK(value("terrace_store_promotions_total", "") == 20);
  CHECK(types["terrace_tier_read_latency_seconds"] == "histogram");

  // Histograms: buckets cumulative (non-decreasing in le order), end in +Inf == _count.
  for (std::string tier : {"hbm", "host", "nvme"}) {
    for (std::string h : {"terrace_tier_read_latency_seconds", "terrace_tier_write_latency_seconds"}) {
      std::vector<std::pair<std::string, double>> buckets;
      std::string prefix = "tier=\"" + tier + "\",le=\"";
      for (const auto& s : samples) {
        if (s.name == h + "_bucket" && s.labels.rfind(prefix, 0) == 0) {
          buckets.emplace_back(s.labels.substr(prefix.size(), s.labels.size() - prefix.size() - 1), s.value);
        }
      }
      INFO(h << " " << tier);
      REQUIRE(buckets.size() >= 2);
      CHECK(buckets.back().first == "+Inf");
      double prev_le = -1, prev = 0;
      for (std::size_t i = 0; i < buckets.size(); ++i) {
        double le = buckets[i].first == "+Inf" ? 1e300 : std::stod(buckets[i].first);
        CHECK(le > prev_le);
        CHECK(buckets[i].second >= prev);
        prev_le = le;
        prev = buckets[i].second;
      }
      CHECK(buckets.back().second == value(h + "_count", "tier=\"" + tier + "\""));
    }
  }
  CHECK(value("terrace_tier_read_latency_seconds_count", "tier=\"nvme\"") == 20);
}

}  // namespace
}  // namespace terrace::testing
