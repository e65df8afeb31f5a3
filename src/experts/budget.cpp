// CacheBudget parsing, the name tables of policies and predictors, and which policy runs with which predictor.
#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "src/common/size_parse.h"
#include "terrace/experts.h"

namespace terrace::experts {
namespace {

constexpr std::string_view kPercentForm = "a percentage of the routed expert bytes such as 25% (0-100]";
constexpr std::string_view kSizeForms = "a size such as 64MiB, 2GiB, 64MB (decimal) or 1048576";

// InvalidArgument "expert cache size 'TEXT' WHY; give FORMS".
Status BadBudget(std::string_view text, std::string_view why, std::string_view forms) {
  return Status::InvalidArgument(fmt::format("expert cache size '{}' {}; give {}", text, why, forms));
}

// The fraction in "P%" (0 < P <= 100); errors say why and offer `forms` (what the caller accepts).
Result<CacheBudget> ParsePercentForm(std::string_view text, std::string_view forms) {
  if (text.empty()) return BadBudget(text, "is empty", forms);
  if (text.back() != '%') return BadBudget(text, "is not a percentage", forms);
  const std::string num(text.substr(0, text.size() - 1));
  char* end = nullptr;
  const double v = std::strtod(num.c_str(), &end);
  if (num.empty() || end != num.c_str() + num.size() || !std::isfinite(v))
    return BadBudget(text, "is not a number followed by %", forms);
  if (!(v > 0.0 && v <= 100.0)) return BadBudget(text, "is outside (0, 100]%", forms);
  CacheBudget b;
  b.fraction = v / 100.0;
  return b;
}

}  // namespace

Result<CacheBudget> CacheBudget::Parse(std::string_view text) {
  const std::string forms = fmt::format("{}, or {}", kPercentForm, kSizeForms);
  if (text.empty() || text.back() == '%') return ParsePercentForm(text, forms);
  // A size: the units every size flag uses (src/common/size_parse.h; MB decimal, MiB binary).
  auto n = ParseSize(text, "expert cache size");
  if (!n.ok()) return Status::InvalidArgument(fmt::format("{}; or give {}", n.status().message(), kPercentForm));
  if (*n == 0) return BadBudget(text, "is zero", forms);
  CacheBudget b;
  b.bytes = *n;
  return b;
}

Result<CacheBudget> CacheBudget::ParsePercent(std::string_view text) { return ParsePercentForm(text, kPercentForm); }

Status CacheBudget::Check() const {
  if (bytes != 0 || (fraction > 0.0 && fraction <= 1.0)) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "expert cache budget fraction {} is outside (0, 1] (a share of the routed expert bytes); set fraction in "
      "(0, 1] or bytes > 0, or build the budget with CacheBudget::Parse",
      fraction));
}

std::uint64_t CacheBudget::Resolve(std::uint64_t total) const {
  if (bytes != 0) return std::min(bytes, total);  // more than every expert buys nothing (and would size tiers)
  if (!Check().ok()) return 0;
  // A double at or past 2^64 (total near 2^64 rounds up) has no uint64 value: that share is `total`.
  const double share = std::floor(static_cast<double>(total) * fraction);
  if (share >= 18446744073709551616.0) return total;
  return std::min(total, static_cast<std::uint64_t>(share));
}

std::string CacheBudget::ToString() const {
  if (bytes != 0) return fmt::format("{} bytes", bytes);
  return fmt::format("{:g}%", fraction * 100.0);
}

namespace {
constexpr std::array<std::pair<std::string_view, CachePolicyKind>, 4> kPolicies{
    {{"lru", CachePolicyKind::kLru}, {"lfu", CachePolicyKind::kLfu}, {"utility", CachePolicyKind::kUtility},
     {"belady", CachePolicyKind::kBelady}}};
constexpr std::array<std::pair<std::string_view, PredictorKind>, 4> kPredictors{
    {{"none", PredictorKind::kNone}, {"lookahead", PredictorKind::kLookahead},
     {"statistical", PredictorKind::kStatistical}, {"oracle", PredictorKind::kOracle}}};
}  // namespace

Result<CachePolicyKind> ParseCachePolicy(std::string_view name) {
  for (const auto& [n, k] : kPolicies)
    if (n == name) return k;
  return Status::InvalidArgument(fmt::format(
      "unknown expert cache policy '{}'; choose lru, lfu, utility or belady (belady only with the oracle predictor)",
      name));
}

Result<PredictorKind> ParsePredictor(std::string_view name) {
  for (const auto& [n, k] : kPredictors)
    if (n == name) return k;
  return Status::InvalidArgument(
      fmt::format("unknown expert predictor '{}'; choose lookahead, statistical, none or oracle", name));
}

Status CheckPolicyPredictor(CachePolicyKind policy, PredictorKind predictor) {
  if (policy != CachePolicyKind::kBelady || predictor == PredictorKind::kOracle) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "the belady cache policy evicts the expert whose next use is farthest ahead, so it needs the future: the "
      "oracle predictor's recorded trace; it cannot run with the {} predictor",
      PredictorName(predictor)));
}

std::string_view CachePolicyName(CachePolicyKind kind) {
  for (const auto& [n, k] : kPolicies)
    if (k == kind) return n;
  return "?";
}

std::string_view PredictorName(PredictorKind kind) {
  for (const auto& [n, k] : kPredictors)
    if (k == kind) return n;
  return "?";
}

}  // namespace terrace::experts
