// Prometheus text exposition: checked with a small independent parser.
#include <catch2/catch.hpp>

#include <map>
#include <cctype>
#include <cstdlib>
#include <sstream>

#include "store_test_util.h"

namespace terrace::testing {
namespace {

struct Sample {
  std::string name, labels;
  double value;
};

bool IsNameStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':'; }
bool IsNameChar(char c) { return IsNameStart(c) || std::isdigit(static_cast<unsigned char>(c)); }

// Reads a metric or label name at `pos`; empty if there is none.
std::string ReadName(const std::string& line, std::size_t& pos, bool allow_colon = true) {
  std::size_t start = pos;
  if (pos < line.size() && IsNameStart(line[pos]) && (allow_colon || line[pos] != ':')) ++pos;
  while (pos > start && pos < line.size() && IsNameChar(line[pos]) && (allow_colon || line[pos] != ':')) ++pos;
  return line.substr(start, pos - start);
}

bool ParseValue(const std::string& text, double* v) {
  if (text == "+Inf") return (*v = 1e300), true;
  if (text.empty()) return false;
  char* end = nullptr;
  *v = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size();
}

// Parses one sample line `name{k="v",...} value`; false if malformed.
bool ParseSample(const std::string& line, Sample* out) {
  std::size_t pos = 0;
  out->name = ReadName(line, pos);
  if (out->name.empty()) return false;
  std::size_t labels_start = pos;
  if (pos < line.size() && line[pos] == '{') {
    ++pos;
    for (;;) {
      if (ReadName(line, pos, false).empty()) return false;
      if (line.compare(pos, 2, "=\"") != 0) return false;
      pos += 2;
      while (pos < line.size() && line[pos] != '"') pos += line[pos] == '\\' ? 2 : 1;  // \\, \", \n
      if (pos >= line.size()) return false;
      ++pos;
      if (pos < line.size() && line[pos] == ',') {
        ++pos;
        continue;
      }
      if (pos < line.size() && line[pos] == '}') break;
      return false;
    }
    out->labels = line.substr(labels_start + 1, pos - labels_start - 1);
    ++pos;
  } else {
    out->labels.clear();
  }
  if (pos >= line.size() || line[pos] != ' ') return false;
  return ParseValue(line.substr(pos + 1), &out->value);
}

// Parses the text format; fails the test on any malformed line.
std::vector<Sample> Parse(const std::string& text, std::map<std::string, std::string>* types) {
  std::vector<Sample> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    INFO("line: " << line);
    if (line.rfind("# TYPE ", 0) == 0) {
      std::istringstream f(line.substr(7));
      std::string name, type, extra;
      f >> name >> type;
      REQUIRE_FALSE(f >> extra);
      REQUIRE((type == "counter" || type == "gauge" || type == "histogram"));
      std::size_t p = 0;
      REQUIRE(ReadName(name, p) == name);
      (*types)[name] = type;
    } else if (line.rfind("# HELP ", 0) == 0) {
      std::size_t p = 7;
      REQUIRE_FALSE(ReadName(line, p).empty());
      REQUIRE(p + 1 < line.size());
      REQUIRE(line[p] == ' ');
    } else {
      Sample s;
      REQUIRE(ParseSample(line, &s));
      out.push_back(s);
    }
  }
  return out;
}

std::string Family(const std::string& name) {
  for (std::string suffix : {"_bucket", "_sum", "_count"}) {
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      return name.substr(0, name.size() - suffix.size());
    }
  }
  return name;
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
    std::string family = Family(s.name);
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

TEST_CASE("PrometheusText exports each tier's read and write histograms, with _sum in seconds") {
  FakeTiers f(1 << 20, 1 << 20, 1 << 20);
  auto store = OpenFakeStore(f);
  for (int i = 0; i < 20; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, 1000), {Codec::kRaw, TierId::kNvme}).ok());
  for (int i = 0; i < 10; ++i) REQUIRE(GetBytes(*store, TestKey(i)).ok());
  std::map<std::string, std::string> types;
  auto samples = Parse(store->PrometheusText(), &types);
  auto value = [&](const std::string& name, const std::string& labels) {
    for (const auto& s : samples) {
      if (s.name == name && s.labels == labels) return s.value;
    }
    FAIL("missing sample " << name << "{" << labels << "}");
    return -1.0;
  };
  CHECK(value("terrace_tier_write_latency_seconds_count", "tier=\"nvme\"") == 20);
  CHECK(value("terrace_tier_read_latency_seconds_count", "tier=\"nvme\"") == 10);
  // The mean latency cannot exceed the smallest finite le bound that holds every sample.
  for (std::string h : {"terrace_tier_read_latency_seconds", "terrace_tier_write_latency_seconds"}) {
    const double count = value(h + "_count", "tier=\"nvme\""), sum = value(h + "_sum", "tier=\"nvme\"");
    double bound = 1e300;
    for (const auto& s : samples) {
      if (s.name != h + "_bucket" || s.labels.rfind("tier=\"nvme\",le=\"", 0) != 0 || s.value < count) continue;
      const std::string le = s.labels.substr(16, s.labels.size() - 17);
      if (le != "+Inf") bound = std::min(bound, std::stod(le));
    }
    INFO(h << " sum " << sum << " count " << count << " bound " << bound);
    CHECK(sum > 0);
    CHECK(sum <= count * bound);
  }
}


TEST_CASE("PrometheusText escapes backslash, double quote and line feed in a tier's name") {
  FakeTiers f(1 << 20, 1 << 20, 1 << 20);
  f.at(TierId::kHost).set_name("a\"b\\c\nd");
  auto store = OpenFakeStore(f);
  REQUIRE(store->Put(TestKey(1), TestBytes(1, 1000)).ok());
  REQUIRE(GetBytes(*store, TestKey(1)).ok());
  const std::string text = store->PrometheusText();
  std::map<std::string, std::string> types;
  const auto samples = Parse(text, &types);  // every line one well-formed sample or comment
  int named = 0;
  for (const auto& s : samples) named += s.labels.rfind("tier=\"a\\\"b\\\\c\\nd\"", 0) == 0;
  CHECK(named >= 16);  // each per-tier gauge and counter, and the host tier's histogram lines
  CHECK_THAT(text, Catch::Contains("terrace_tier_hits_total{tier=\"a\\\"b\\\\c\\nd\"} 1"));
}

// le="0.000000959" -> 959.
std::uint64_t LeNanos(const std::string& le) {
  const std::size_t dot = le.find('.');
  std::string frac = dot == std::string::npos ? "" : le.substr(dot + 1);
  REQUIRE(frac.size() <= 9);
  frac.resize(9, '0');
  return std::stoull(le.substr(0, dot)) * 1'000'000'000ull + std::stoull(frac);
}

TEST_CASE("Each histogram le bound is the last value of a latency bucket, so a bucket counts exactly the values <= le") {
  FakeTiers f(1 << 20, 1 << 20, 1 << 20);
  auto store = OpenFakeStore(f);
  REQUIRE(store->Put(TestKey(1), TestBytes(1, 1000)).ok());
  std::map<std::string, std::string> types;
  const auto samples = Parse(store->PrometheusText(), &types);
  int bounds = 0;
  for (const auto& s : samples) {
    const std::size_t at = s.labels.find(",le=\"");
    if (s.name.find("_bucket") == std::string::npos || at == std::string::npos) continue;
    const std::string le = s.labels.substr(at + 5, s.labels.size() - at - 6);
    if (le == "+Inf") continue;
    INFO(s.name << "{" << s.labels << "}");
    const std::uint64_t ns = LeNanos(le);
    // A bound inside a bucket would count that bucket's values above it (or leave out those below).
    bool edge = false;
    for (int b = 0; b < LatencyHistogram::kBuckets; ++b) edge = edge || LatencyHistogram::BucketUpperBound(b) == ns;
    CHECK(edge);
    CHECK(ns <= 10'000'000'000ull);
    ++bounds;
  }
  CHECK(bounds == 2 * 3 * 22);  // read and write histograms, 3 tiers, 22 bounds each
}

}  // namespace
}  // namespace terrace::testing
