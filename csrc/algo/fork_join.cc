#include "algo/fork_join.h"

#include <algorithm>

namespace linkwise {

ForkJoin::~ForkJoin() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : helpers_) t.join();
}

void ForkJoin::take(int thread) {
  for (;;) {
    const int i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= parts_) return;
    try {
      (*job_)(i, thread);
    } catch (...) {
      std::lock_guard<std::mutex> g(mu_);
      if (!err_) err_ = std::current_exception();
      next_.store(parts_, std::memory_order_relaxed);  // stop handing out parts
    }
  }
}

void ForkJoin::helper(int index) {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    start_cv_.wait(l, [&] { return stop_ || gen_ != seen; });
    if (stop_) return;
    seen = gen_;
    l.unlock();
    take(index);
    l.lock();
    if (--busy_ == 0) done_cv_.notify_all();
  }
}

void ForkJoin::run(int parts, const std::function<void(int, int)>& f) {
  const int want = std::min(threads_, parts) - 1;  // helpers with work in this job
  if (want <= 0) {
    for (int i = 0; i < parts; ++i) f(i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    while (static_cast<int>(helpers_.size()) < threads_ - 1) {
      const int index = static_cast<int>(helpers_.size()) + 1;
      helpers_.emplace_back([this, index] { helper(index); });
    }
    job_ = &f;
    parts_ = parts;
    next_.store(0, std::memory_order_relaxed);
    err_ = nullptr;
    busy_ = static_cast<int>(helpers_.size());
    ++gen_;
  }
  start_cv_.notify_all();
  take(0);
  std::unique_lock<std::mutex> l(mu_);
  done_cv_.wait(l, [&] { return busy_ == 0; });
  job_ = nullptr;
  if (err_) std::rethrow_exception(err_);
}

}  // namespace linkwise
