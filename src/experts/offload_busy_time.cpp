// How long the expert loads kept the drive busy (offload_impl.h): the union of the loads'
// intervals, kept bounded over a long run, and its share per decode step for the predictor.
#include "src/experts/offload_impl.h"

namespace terrace::experts {

using namespace offload;

void ExpertOffload::Impl::ReportLoadBusyShare() {
  const std::uint64_t now = SteadyNanos(), busy = LoadBusyNs(now);
  if (step_start_ns != 0 && now > step_start_ns) {
    const double share = static_cast<double>(busy - std::min(busy, step_start_busy_ns)) /
                         static_cast<double>(now - step_start_ns);
    predictor->OnLoadBusyShare(std::clamp(share, 0.0, 1.0));
  }
  step_start_ns = now;
  step_start_busy_ns = busy;
}

void ExpertOffload::Impl::MergeIntervals(std::vector<std::pair<std::uint64_t, std::uint64_t>>& iv) {
  std::sort(iv.begin(), iv.end());
  std::size_t n = 0;
  for (const auto& x : iv) {
    if (n > 0 && x.first <= iv[n - 1].second) {
      iv[n - 1].second = std::max(iv[n - 1].second, x.second);
    } else {
      iv[n++] = x;
    }
  }
  iv.resize(n);
}

void ExpertOffload::Impl::AddLoadInterval(std::uint64_t start, std::uint64_t end) {
  load_iv.emplace_back(start, end);
  if (load_iv.size() < 4096) return;
  std::uint64_t horizon = SteadyNanos();
  for (const InFlight& f : inflight)
    if (f.unbooked > 0) horizon = std::min(horizon, f.issue_ns);
  MergeIntervals(load_iv);
  std::size_t keep = 0;
  while (keep < load_iv.size() && load_iv[keep].second < horizon) {
    load_busy_folded += load_iv[keep].second - load_iv[keep].first;
    ++keep;
  }
  load_iv.erase(load_iv.begin(), load_iv.begin() + static_cast<std::ptrdiff_t>(keep));
}

std::uint64_t ExpertOffload::Impl::LoadBusyNs(std::uint64_t open_until) const {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> iv = load_iv;
  if (open_until != 0) {
    for (const InFlight& f : inflight) {
      std::uint64_t end = 0;
      for (std::size_t k = 0; k < f.slot_ids.size(); ++k)
        if (!f.booked[k]) end = std::max(end, f.landing->DoneNs(k, open_until));
      if (end > f.issue_ns) iv.emplace_back(f.issue_ns, end);
    }
  }
  std::uint64_t folded = load_busy_folded;
  std::sort(iv.begin(), iv.end());
  std::uint64_t busy = 0, cur_start = 0, cur_end = 0;
  bool open = false;
  for (const auto& [a, b] : iv) {
    if (!open || a > cur_end) {
      if (open) busy += cur_end - cur_start;
      cur_start = a;
      cur_end = b;
      open = true;
    } else {
      cur_end = std::max(cur_end, b);
    }
  }
  if (open) busy += cur_end - cur_start;
  return busy + folded;
}

}  // namespace terrace::experts
