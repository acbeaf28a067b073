#include "algo/fork_join.h"

#include <algorithm>
#include <chrono>

#include "core/wait.h"

namespace linkwise {

ForkJoin::~ForkJoin() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_.store(true, std::memory_order_release);
  }
  start_cv_.notify_all();
  for (auto& t : helpers_) t.join();
}

bool ForkJoin::spin_until(const std::function<bool()>& ready) const {
  if (ready()) return true;
  if (spin_us_ <= 0) return false;
  const auto t0 = Clock::now();
  do {
    for (int i = 0; i < 32; ++i) {
      if (ready()) return true;
      cpu_relax();
    }
  } while (seconds_since(t0) * 1e6 < spin_us_);
  return ready();
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
  auto news = [&] { return stop_.load(std::memory_order_acquire) || gen_.load(std::memory_order_acquire) != seen; };
  for (;;) {
    if (!spin_until(news)) {
      std::unique_lock<std::mutex> l(mu_);
      start_cv_.wait(l, news);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = gen_.load(std::memory_order_acquire);
    take(index);
    if (busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> g(mu_);  // the owner checks busy_ under mu_ before it sleeps
      done_cv_.notify_all();
    }
  }
}

void ForkJoin::run(int parts, const std::function<void(int, int)>& f, const std::function<void()>& on_interrupt) {
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
    busy_.store(static_cast<int>(helpers_.size()), std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_release);  // under mu_: a helper about to sleep sees it
  }
  start_cv_.notify_all();
  take(0);
  auto done = [&] { return busy_.load(std::memory_order_acquire) == 0; };
  if (!spin_until(done)) {
    std::unique_lock<std::mutex> l(mu_);
    bool told = !on_interrupt;
    // In slices of 0.1 s while Ctrl-C may still matter (interrupted() takes the GIL: not under mu_).
    while (!done_cv_.wait_for(l, std::chrono::milliseconds(told ? 1000 : 100), done)) {
      if (told) continue;
      l.unlock();
      if (interrupted()) {
        told = true;
        on_interrupt();
      }
      l.lock();
    }
  }
  job_ = nullptr;
  std::lock_guard<std::mutex> g(mu_);
  if (err_) std::rethrow_exception(err_);
}

}  // namespace linkwise
