// model::ChainHooks: for every ForwardOptions callback, first's runs before then's with the same
// arguments; an unset side is dropped; on_layer_begin stops at first's error; the other fields are first's.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include <fmt/format.h>

#include "terrace/model.h"

namespace terrace::model {
namespace {

using Log = std::vector<std::string>;

// Every callback set; each appends "<tag> <field> <its arguments>" to *log. on_layer_begin returns `begin`.
ForwardOptions Recorder(const std::string& tag, Log* log, Status begin = Status::Ok()) {
  ForwardOptions o;
  o.on_routing = [=](int layer, const Routing& r) {
    log->push_back(fmt::format("{} routing {} {}", tag, layer, r.top_k));
  };
  o.on_layer_end = [=](int layer, std::span<const float> h, std::int64_t tokens) {
    log->push_back(fmt::format("{} layer_end {} {} {}", tag, layer, h.size(), tokens));
  };
  o.on_ffn_input = [=](int layer, std::span<const float> h, std::int64_t tokens) {
    log->push_back(fmt::format("{} ffn_input {} {} {}", tag, layer, h.size(), tokens));
  };
  o.on_embedding = [=](std::span<const float> h, std::int64_t tokens) {
    log->push_back(fmt::format("{} embedding {} {}", tag, h.size(), tokens));
  };
  o.on_layer_begin = [=](int layer, std::int64_t tokens) {
    log->push_back(fmt::format("{} layer_begin {} {}", tag, layer, tokens));
    return begin;
  };
  o.on_mla_attention = [=](int layer, std::int64_t head, std::span<const float> p, std::int64_t tokens,
                           std::int64_t positions) {
    log->push_back(fmt::format("{} mla_attention {} {} {} {} {}", tag, layer, head, p.size(), tokens, positions));
  };
  return o;
}

// Calls each of o's callbacks once (unset ones skipped), in field order; the Status of on_layer_begin.
Status CallAll(const ForwardOptions& o) {
  const std::vector<float> h(6);
  Routing r;
  r.top_k = 2;
  if (o.on_routing) o.on_routing(3, r);
  if (o.on_layer_end) o.on_layer_end(4, h, 2);
  if (o.on_ffn_input) o.on_ffn_input(5, h, 3);
  if (o.on_embedding) o.on_embedding(h, 1);
  if (o.on_mla_attention) o.on_mla_attention(6, 7, h, 2, 3);
  return o.on_layer_begin ? o.on_layer_begin(8, 9) : Status::Ok();
}

// What CallAll logs for one side's Recorder (tag), per field in CallAll's order.
Log Expected(const std::string& tag) {
  return {tag + " routing 3 2",  tag + " layer_end 4 6 2",        tag + " ffn_input 5 6 3",
          tag + " embedding 6 1", tag + " mla_attention 6 7 6 2 3", tag + " layer_begin 8 9"};
}

// The unset callbacks of o, by name (empty: all six are set).
std::vector<std::string> Unset(const ForwardOptions& o) {
  std::vector<std::string> unset;
  if (!o.on_routing) unset.push_back("on_routing");
  if (!o.on_layer_end) unset.push_back("on_layer_end");
  if (!o.on_ffn_input) unset.push_back("on_ffn_input");
  if (!o.on_embedding) unset.push_back("on_embedding");
  if (!o.on_layer_begin) unset.push_back("on_layer_begin");
  if (!o.on_mla_attention) unset.push_back("on_mla_attention");
  return unset;
}

TEST_CASE("ChainHooks runs first's callback, then then's, for every field, with the same arguments", "[model][hooks]") {
  Log log;
  const ForwardOptions chained = ChainHooks(Recorder("A", &log), Recorder("B", &log));
  CHECK(Unset(chained).empty());
  CHECK(CallAll(chained).ok());
  Log want;
  const Log a = Expected("A"), b = Expected("B");
  for (std::size_t i = 0; i < a.size(); ++i) want.insert(want.end(), {a[i], b[i]});
  CHECK(log == want);
}

TEST_CASE("ChainHooks takes an unset side's partner as is; both unset stays unset", "[model][hooks]") {
  Log log;
  SECTION("then unset") {
    CHECK(CallAll(ChainHooks(Recorder("A", &log), ForwardOptions{})).ok());
    CHECK(log == Expected("A"));
  }
  SECTION("first unset") {
    CHECK(CallAll(ChainHooks(ForwardOptions{}, Recorder("B", &log))).ok());
    CHECK(log == Expected("B"));
  }
  SECTION("both unset") {
    CHECK(Unset(ChainHooks(ForwardOptions{}, ForwardOptions{})).size() == 6);
  }
  SECTION("one field set on each side") {
    ForwardOptions first, then;
    first.on_embedding = Recorder("A", &log).on_embedding;
    then.on_layer_end = Recorder("B", &log).on_layer_end;
    const ForwardOptions chained = ChainHooks(first, then);
    const std::vector<std::string> unset = {"on_routing", "on_ffn_input", "on_layer_begin", "on_mla_attention"};
    CHECK(Unset(chained) == unset);
    CHECK(CallAll(chained).ok());
    CHECK(log == Log{"B layer_end 4 6 2", "A embedding 6 1"});
  }
}

TEST_CASE("ChainHooks' on_layer_begin returns first's error unchanged without calling then's", "[model][hooks]") {
  Log log;
  SECTION("first fails") {
    const Status s = CallAll(ChainHooks(Recorder("A", &log, Status::Cancelled("stop at A")), Recorder("B", &log)));
    CHECK(s.code() == Code::kCancelled);
    CHECK(s.message() == "stop at A");
    CHECK(log.back() == "A layer_begin 8 9");
  }
  SECTION("then fails") {
    const Status s = CallAll(ChainHooks(Recorder("A", &log), Recorder("B", &log, Status::IoError("B failed"))));
    CHECK(s.code() == Code::kIoError);
    CHECK(s.message() == "B failed");
    CHECK(Log(log.end() - 2, log.end()) == Log{"A layer_begin 8 9", "B layer_begin 8 9"});
  }
}

TEST_CASE("ChainHooks keeps first's other fields", "[model][hooks]") {
  Profile profile;
  ForwardOptions first, then;
  first.chunked_kda = false;
  first.absorbed_mla = true;
  first.all_logits = false;
  first.profile = &profile;
  then.chunked_kda = true;
  then.absorbed_mla = false;
  then.all_logits = true;
  const ForwardOptions chained = ChainHooks(first, then);
  CHECK(!chained.chunked_kda);
  CHECK(chained.absorbed_mla);
  CHECK(!chained.all_logits);
  CHECK(chained.profile == &profile);
}

}  // namespace
}  // namespace terrace::model
