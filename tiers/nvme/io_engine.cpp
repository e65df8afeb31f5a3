#include "tiers/nvme/io_engine.h"

#include <cerrno>
#include <vector>

namespace terrace::nvme {
namespace {
constexpr int kMaxRounds = 16;  // resubmission rounds before a stalled request fails
}  // namespace

void RunToCompletion(IoEngine& engine, std::span<IoRequest> reqs,
                     const std::function<void(std::size_t, int)>& on_done_once) {
  // A request the engine never reports (a broken ring) still gets exactly one verdict.
  std::vector<bool> settled(reqs.size(), false);
  auto on_done = [&](std::size_t i, int err) {
    if (settled[i]) return;
    settled[i] = true;
    on_done_once(i, err);
  };
  std::vector<std::size_t> retry;       // indices into reqs still needing work
  std::vector<IoRequest> round_reqs;
  std::vector<std::size_t> round_map;   // round index -> reqs index

  auto settle = [&](std::size_t i, const IoRequest& done_req) {
    IoRequest& r = reqs[i];
    int res = done_req.result;
    if (res == static_cast<int>(r.len)) {
      on_done(i, 0);
    } else if (res == -EAGAIN || res == -EINTR) {
      retry.push_back(i);
    } else if (res < 0) {
      on_done(i, res);
    } else if (res == 0) {
      on_done(i, -EIO);  // no progress: end of file or a device that stopped transferring
    } else {
      r.offset += static_cast<std::uint64_t>(res);
      if (r.op == IoOp::kRead) {
        r.buf += res;
      } else {
        r.src += res;
      }
      r.len -= static_cast<std::uint32_t>(res);
      retry.push_back(i);
    }
  };

  IoCompletion first = [&](std::size_t i) { settle(i, reqs[i]); };
  engine.Execute(reqs, &first);

  for (int round = 1; !retry.empty(); ++round) {
    if (round > kMaxRounds) {
      for (std::size_t i : retry) on_done(i, reqs[i].result < 0 ? reqs[i].result : -EIO);
      retry.clear();
      break;
    }
    round_reqs.clear();
    round_map.clear();
    for (std::size_t i : retry) {
      round_reqs.push_back(reqs[i]);
      round_map.push_back(i);
    }
    retry.clear();
    IoCompletion cb = [&](std::size_t j) {
      reqs[round_map[j]].result = round_reqs[j].result;
      reqs[round_map[j]].submit_ns = round_reqs[j].submit_ns;
      reqs[round_map[j]].complete_ns = round_reqs[j].complete_ns;
      settle(round_map[j], round_reqs[j]);
    };
    engine.Execute(round_reqs, &cb);
  }
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    if (!settled[i]) on_done(i, -EIO);
  }
}

}  // namespace terrace::nvme
