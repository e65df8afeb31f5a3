"""Monte Carlo of expert-cache hit rates under a top-k router that draws its k experts one after
another without repeats (a Gumbel top-k draw over Zipf(s) weights), against which docs/plan.md
compares `terrace plan`'s inclusion model (computed here too). Needs numpy.

    python3 bench/plan/topk_hit_rate_mc.py      # the three cases quoted in docs/plan.md
"""
import numpy as np


def monte_carlo(experts, top_k, cached, s=1.0, tokens=20000, seed=1):
    """(hit rate of caching the hottest `cached`, share of tokens that pick the hottest expert)."""
    rng = np.random.default_rng(seed)
    log_w = np.log(1.0 / np.arange(1, experts + 1) ** s)
    hits = top = 0
    for _ in range(tokens // 2000):
        keys = log_w + rng.gumbel(size=(2000, experts))
        picks = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
        hits += int((picks < cached).sum())
        top += int((picks == 0).any(axis=1).sum())
    return hits / (tokens * top_k), top / tokens


def inclusion_model(experts, top_k, cached, s=1.0):
    """The planner's model (docs/plan.md): p_i = min(1, c w_i), the p_i summing to top_k."""
    w = 1.0 / np.arange(1, experts + 1) ** s
    saturated = 0
    while True:
        c = (top_k - saturated) / w[saturated:].sum()
        if c * w[saturated] <= 1.0:
            break
        saturated += 1
    p = np.minimum(1.0, c * w)
    p[:saturated] = 1.0
    return p[:cached].sum() / top_k


if __name__ == "__main__":
    for experts, top_k, cached in ((896, 16, 338), (256, 8, 64), (16, 4, 4)):
        hit, top = monte_carlo(experts, top_k, cached)
        model = inclusion_model(experts, top_k, cached)
        print(f"{experts} experts, top-{top_k}, {cached} cached: Monte Carlo hit rate {hit:.3f} (hottest expert in "
              f"{top:.1%} of tokens), the planner's model {model:.3f}")
