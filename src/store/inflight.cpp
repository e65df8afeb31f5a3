#include "src/store/inflight.h"

namespace terrace::store_internal {

InflightTable::Ticket InflightTable::JoinOrLead(const BlockKey& key, bool by_prefetch, bool wants_bytes) {
  MutexLock lock(&mu_);
  auto [it, inserted] = fetches_.try_emplace(key);
  if (inserted) {
    it->second = std::make_shared<Fetch>();
    it->second->by_prefetch = by_prefetch;
    it->second->leader = std::this_thread::get_id();
  } else if (wants_bytes) {
    ++it->second->readers;
  }
  return Ticket{it->second, inserted};
}

std::size_t InflightTable::Close(const BlockKey& key, const std::shared_ptr<Fetch>& fetch) {
  MutexLock lock(&mu_);
  auto it = fetches_.find(key);
  if (it != fetches_.end() && it->second == fetch) fetches_.erase(it);
  return fetch->readers;
}

void InflightTable::Wake(Fetch& fetch) {
  {
    MutexLock lock(&fetch.mu);
    fetch.done = true;
  }
  fetch.cv.SignalAll();
}

void InflightTable::Wait(Fetch& fetch) {
  MutexLock lock(&fetch.mu);
  while (!fetch.done) fetch.cv.Wait(&fetch.mu);
}

}  // namespace terrace::store_internal
