// ChainHooks (terrace/model.h): one ForwardOptions whose callbacks run two sides' in order.
#include <type_traits>
#include <utility>

#include "terrace/model.h"

namespace terrace::model {
namespace {

// first then `then`; a Status-returning callback stops at first's error. An unset side is dropped.
template <class R, class... Args>
std::function<R(Args...)> Chain(std::function<R(Args...)> first, std::function<R(Args...)> then) {
  if (!first) return then;
  if (!then) return first;
  return [first = std::move(first), then = std::move(then)](Args... args) -> R {
    if constexpr (std::is_same_v<R, Status>) {
      TERRACE_RETURN_IF_ERROR(first(args...));
    } else {
      first(args...);
    }
    return then(args...);
  };
}

}  // namespace

ForwardOptions ChainHooks(ForwardOptions first, ForwardOptions then) {
  first.on_routing = Chain(std::move(first.on_routing), std::move(then.on_routing));
  first.on_layer_end = Chain(std::move(first.on_layer_end), std::move(then.on_layer_end));
  first.on_ffn_input = Chain(std::move(first.on_ffn_input), std::move(then.on_ffn_input));
  first.on_embedding = Chain(std::move(first.on_embedding), std::move(then.on_embedding));
  first.on_layer_begin = Chain(std::move(first.on_layer_begin), std::move(then.on_layer_begin));
  first.on_mla_attention = Chain(std::move(first.on_mla_attention), std::move(then.on_mla_attention));
  return first;
}

}  // namespace terrace::model
