// Waiting: spinning, sleeping on the transports, timeouts, and the progress thread.
// See engine.h for the threading contract.
#include <algorithm>
#include <string>
#include <thread>

#include "core/wait.h"
#include "p2p/engine_internal.h"

namespace linkwise {

namespace {
constexpr int64_t kSliceUs = 100000;  // while asleep, look for dead peers this often
// A sender whose receiver copies a pulled message waits for an ack that comes when the copy
// ends: 60 us for 512 KiB on the 2-core VM, longer than the plain spin, and a futex wake-up
// there costs 100 us or more (a 512 KiB exchange took 150-620 us against 63-84 with a long
// spin). So a waiter keeps spinning until the copies it announced are due, reckoned at
// kPullSpinBytesPerUs (~1/8 of one core's copy rate there, so a slow copy is still covered),
// each at most kPullSpinMaxUs. Only where spinning is on (kSpinningMinUs): a rank without a
// core of its own (spin ~1 us) would take it from the peer doing the copy.
constexpr double kPullSpinBytesPerUs = 1000.0;
constexpr double kPullSpinMaxUs = 5000.0;
constexpr double kSpinningMinUs = 10.0;  // a configured spin this long means a core per rank
// Adaptive spin (where spinning is on: kSpinningMinUs). A chain of waits (a ring of
// sendrecvs, each rank waiting for its predecessor) falls into a self-sustaining slow mode
// with a short spin: one rank sleeps, its wake-up makes it late, so its successor's wait
// outlasts the spin and it sleeps too (16 ranks on the 16-core host: 8 B sendrecv 22-44 us a call, 2.6-3.3 with a 2 ms
// spin; Open MPI, which never sleeps, 2.5-3.2). So a wait whose sleep ended within kSpinMaxUs
// (spinning that long would have caught it) raises the budget to twice the budget or twice
// the sleep, whichever is more, up to kSpinMaxUs; one that slept longer than
// kSpinShrinkAfterUs (the peer was busy elsewhere) halves it, down to the configured spin.
// (Doubling only after sleeps shorter than the budget could stay stuck: once the ranks sleep
// in turn, each sleep lasts a wake-up and more, longer than a small budget.)
constexpr double kSpinMaxUs = 2000.0;
constexpr double kSpinShrinkAfterUs = 10000.0;
}  // namespace
using engine_detail::tag_text;

void Engine::wake_all() {
  for (auto& t : transports_) t->wake();
}

void Engine::sleep_once(int64_t timeout_us, const std::function<bool()>& ready) {
  sleepers_.fetch_add(1);
  std::vector<uint32_t> tokens(transports_.size());
  for (size_t i = 0; i < transports_.size(); ++i) tokens[i] = transports_[i]->begin_sleep();
  bool moved;
  {
    std::lock_guard<std::mutex> g(mu_);
    moved = progress_locked();
    // About to sleep: take every deferred single-copy message now, so that its sender, which
    // may be what we are waiting for, can finish.
    if (!moved) materialize_deferred_locked();
  }
  if (!moved && !ready()) {
    if (transports_.empty()) {
      std::this_thread::sleep_for(std::chrono::microseconds(std::min<int64_t>(timeout_us, 200)));
    } else {
      // With several transports (shared memory and TCP at once) none can sleep on all the
      // others' events: take turns in short naps.
      int64_t nap = transports_.size() == 1 ? timeout_us : std::min<int64_t>(timeout_us, 1000);
      for (size_t i = 0; i < transports_.size(); ++i) transports_[i]->sleep(tokens[i], i == 0 ? nap : 0);
    }
  }
  for (auto& t : transports_) t->end_sleep();
  sleepers_.fetch_sub(1);
}

void Engine::note_pull_announced(size_t bytes) {
  if (opt_.spin_us < kSpinningMinUs) return;
  const double us = std::min(kPullSpinMaxUs, static_cast<double>(bytes) / kPullSpinBytesPerUs);
  const auto due = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(us));
  if (due > pulls_due_) pulls_due_ = due;
}

// Whether a waiter past its plain spin should go on spinning: a pulled message it announced
// is not acknowledged yet, and not overdue.
bool Engine::spin_for_pulls_locked(Clock::time_point now) const {
  if (now >= pulls_due_) return false;
  for (const auto& p : peers_)
    if (!p->awaiting_ack.empty()) return true;
  return false;
}

void Engine::adapt_spin(double budget_us, double slept_us) {
  if (opt_.spin_us < kSpinningMinUs) return;
  double next = budget_us;
  if (slept_us <= kSpinMaxUs)
    next = std::min(kSpinMaxUs, 2 * std::max(budget_us, slept_us));
  else if (slept_us > kSpinShrinkAfterUs)
    next = std::max(opt_.spin_us, budget_us / 2);
  spin_budget_us_.store(next, std::memory_order_relaxed);
}

// A request that started moving cannot be withdrawn: the engine aborts. For a point-to-point
// request the peers are told too (a notice, or the link closed when mid-message), so their
// matching call raises PeerError at once rather than wait for the rest until its own timeout;
// a collective's request is left to its collective (CollCtx::abort_after_failure), whose notice
// names its own number (lower than the next, which a notice sent here names: a second notice
// goes out for the lower number, Engine::notify_abort_locked).
void Engine::give_up_moving(const Request& req, const std::string& why) {
  if (engine_detail::is_coll_tag(req.tag))
    abort(why);
  else
    abort_and_notify(why, -1, next_collective());
}

void Engine::wait(Request& req, double timeout_s, const char* op, double named_s) {
  check_timeout(timeout_s, op);  // a request's own wait(timeout=); the posting calls checked theirs
  if (!req.done()) {
    const auto t0 = Clock::now();
    const double budget_us = spin_budget_us_.load(std::memory_order_relaxed);
    while (!req.done()) {
      bool spin_on;
      {
        std::lock_guard<std::mutex> g(mu_);
        progress_locked();
        const auto now = Clock::now();
        spin_on = std::chrono::duration<double, std::micro>(now - t0).count() < budget_us ||
                  spin_for_pulls_locked(now);
      }
      if (req.done() || !spin_on) break;
      cpu_relax();
    }
    const auto sleep_start = Clock::now();
    const bool slept = !req.done();
    auto last_reap = sleep_start;
    while (!req.done()) {
      double left = timeout_s - seconds_since(t0);
      if (left <= 0) {
        if (cancel(req) || !req.done()) {
          if (!req.done()) give_up_moving(req, "an operation timed out in the middle of a transfer");
          throw Error(ErrorKind::Timeout,
                      "rank " + std::to_string(rank_) + ": " + op + " with rank " + std::to_string(req.peer) +
                          " (" + tag_text(req.tag) + ") did not complete within " +
                          seconds_text(named_s >= 0 ? named_s : timeout_s) +
                          "; check that the peer posts the matching call, or raise LINKWISE_TIMEOUT / timeout=",
                      req.peer);
        }
        break;
      }
      sleep_once(left * 1e6 >= kSliceUs ? kSliceUs : static_cast<int64_t>(left * 1e6) + 1, [&] { return req.done(); });
      if (seconds_since(last_reap) >= 0.1 && !req.done()) {
        {
          std::lock_guard<std::mutex> g(mu_);
          reap_dead_peers_locked();
          last_reap = Clock::now();
        }
        // Ctrl-C: given up as on a timeout (a request that started moving aborts the engine).
        // Its handler's exception is taken, so it is raised even if req completed meanwhile.
        if (interrupted()) {
          if (!cancel(req) && !req.done()) give_up_moving(req, "an operation was interrupted in the middle of a transfer");
          throw_interrupted(rank_, std::string(op) + " with rank " + std::to_string(req.peer) + " (" +
                                       tag_text(req.tag) + ")");
        }
      }
    }
    if (slept) adapt_spin(budget_us, seconds_since(sleep_start) * 1e6);
  }
  req.rethrow();
}

bool Engine::test(Request& req) {
  if (req.done()) return true;
  std::lock_guard<std::mutex> g(mu_);
  progress_locked();
  // A caller that polls test() must learn of a dead peer too, as wait() does: at most every
  // 0.1 s, since the check costs a system call per peer with pending work.
  if (!req.done() && seconds_since(last_test_reap_) >= 0.1) {
    reap_dead_peers_locked();
    last_test_reap_ = Clock::now();
  }
  return req.done();
}

void Engine::note_async_posted() {
  {
    std::lock_guard<std::mutex> g(thread_mu_);
    if (!progress_thread_.joinable() && !stop_thread_)
      progress_thread_ = OwnedThread([this] { progress_thread_main(); });
  }
  thread_cv_.notify_all();
  wake_all();
}

void Engine::progress_thread_main() {
  auto last_reap = Clock::now();
  while (true) {
    {
      std::unique_lock<std::mutex> l(thread_mu_);
      thread_cv_.wait(l, [&] { return stop_thread_ || pending_async_.load() > 0; });
      if (stop_thread_) return;
    }
    while (pending_async_.load() > 0) {
      {
        std::lock_guard<std::mutex> g(thread_mu_);
        if (stop_thread_) return;
      }
      sleep_once(kSliceUs, [&] { return pending_async_.load() == 0; });
      if (seconds_since(last_reap) >= 0.1) {
        std::lock_guard<std::mutex> g(mu_);
        reap_dead_peers_locked();
        last_reap = Clock::now();
      }
    }
  }
}

}  // namespace linkwise
