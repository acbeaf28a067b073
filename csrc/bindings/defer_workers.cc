// DeferWorkers (defer_workers.h has the contract).
#include "bindings/defer_workers.h"

#include <chrono>
#include <utility>

#include "bindings/native_comm.h"
#include "core/status.h"

namespace linkwise {

DeferWorkers::DeferWorkers(DeferTarget* target, int nranks)
    : target_(target), queues_(nranks), pending_(nranks, 0), current_(nranks, nullptr), threads_(nranks) {}

DeferWorkers::~DeferWorkers() {
  {
    PyThreadState* saved = PyEval_SaveThread();  // threads may be inside a wait: no GIL held there
    close(0.0);
    PyEval_RestoreThread(saved);
  }
  reap();
}

void DeferWorkers::post(Item item) {
  std::unique_lock<std::mutex> l(mu_);
  if (failure_ || closed_) {
    target_->drop(item.event);
    retire_locked(item);
    const bool closed = closed_ && !failure_;
    std::exception_ptr e = failure_;
    l.unlock();
    reap();
    if (closed) throw Error(ErrorKind::Invalid, "recv: the GPU communicator is closed");
    std::rethrow_exception(e);
  }
  const int src = item.src;
  ++pending_[src];
  queues_[src].push_back(std::move(item));
  if (!threads_[src].joinable()) threads_[src] = OwnedThread([this, src] { serve(src); });
  l.unlock();
  cv_.notify_all();
  reap();
}

bool DeferWorkers::busy(int src) {
  bool b;
  {
    std::lock_guard<std::mutex> l(mu_);
    b = pending_[src] > 0;
  }
  reap();
  return b;
}

bool DeferWorkers::failed() {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<bool>(failure_);
}

void DeferWorkers::rethrow() {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> l(mu_);
    e = failure_;
  }
  if (e) std::rethrow_exception(e);
}

void DeferWorkers::reap() {
  std::vector<PyObject*> drop;
  {
    std::lock_guard<std::mutex> l(mu_);
    drop.swap(retired_);
  }
  for (PyObject* o : drop) Py_XDECREF(o);  // outside mu_: a finalizer may call back in
}

void DeferWorkers::close(double timeout_s) {
  std::vector<std::pair<std::shared_ptr<NativeComm>, std::shared_ptr<Request>>> waiting;
  bool stuck;
  {
    std::unique_lock<std::mutex> l(mu_);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    auto left = [&] {
      for (int p : pending_)
        if (p) return true;
      return false;
    };
    cv_.wait_until(l, deadline, [&] { return !left() || failure_ || closed_; });
    stuck = left() && !failure_ && !closed_;
    closed_ = true;
    // The host requests still waiting for a description are withdrawn, so their threads stop
    // waiting (a withdrawn request fails at once) and no later message matches them.
    for (size_t s = 0; s < queues_.size(); ++s) {
      if (current_[s] && current_[s]->req) waiting.emplace_back(current_[s]->comm, current_[s]->req);
      for (const Item& it : queues_[s])
        if (it.req) waiting.emplace_back(it.comm, it.req);
    }
  }
  cv_.notify_all();
  for (auto& [comm, req] : waiting) comm->engine().cancel(*req);
  {
    std::lock_guard<std::mutex> g(gate_);  // a thread inside the target finishes first
    if (stuck) target_->abort(-1);          // queued receives' device waits give up at once
  }
  for (auto& t : threads_)
    if (t.joinable()) t.join();
}

void DeferWorkers::retire_locked(Item& item) {
  for (PyObject*& o : item.held) {
    if (o) retired_.push_back(o);
    o = nullptr;
  }
}

void DeferWorkers::drop_queue_locked(int src) {
  for (Item& it : queues_[src]) {
    target_->drop(it.event);
    if (it.req) it.comm->engine().cancel(*it.req);
    retire_locked(it);
  }
  queues_[src].clear();
  pending_[src] = 0;
}

void DeferWorkers::serve(int src) {
  while (true) {
    Item item;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return closed_ || failure_ || !queues_[src].empty(); });
      if (closed_ || failure_) {
        drop_queue_locked(src);
        return;
      }
      item = std::move(queues_[src].front());  // still pending until enqueued (busy stays true)
      queues_[src].pop_front();
      current_[src] = &item;
    }
    bool taken = false;  // finish was called: it owns the event, even when it throws
    try {
      std::string desc;
      if (item.req) {  // the sender's description (the communicator's timeout)
        item.comm->engine().wait(*item.req, item.timeout_s, "recv");
        // flag 0: the sender's buffer could not be exported, so it sends through the scratch
        if (item.msg[0]) desc.assign(reinterpret_cast<const char*>(item.msg) + 1, item.desc_bytes);
      }
      std::lock_guard<std::mutex> g(gate_);
      if (!closed_) {
        taken = true;
        target_->finish(item.event, item.x, item.nbytes, src, desc);
      }
    } catch (...) {
      std::unique_lock<std::mutex> l(mu_);
      current_[src] = nullptr;
      const bool closing = closed_;
      l.unlock();
      if (!taken) target_->drop(item.event);
      if (!closing) fail(src, std::current_exception());  // a withdrawn wait after close is no failure
      std::lock_guard<std::mutex> relock(mu_);
      retire_locked(item);
      if (closing) continue;
      return;
    }
    if (!taken) target_->drop(item.event);
    std::lock_guard<std::mutex> l(mu_);
    current_[src] = nullptr;
    retire_locked(item);
    if (pending_[src] > 0) --pending_[src];
    cv_.notify_all();
  }
}

void DeferWorkers::fail(int src, std::exception_ptr e) {
  // Recorded first, then the abort, both under the gate: a caller whose device wait the abort
  // ends finds the failure that caused it (what it raises), and a close() that sees the
  // failure takes the gate after us, so finds the target aborted (its device sync would wait
  // for the deferred waits until the timeout otherwise). Lock order: gate_, then mu_.
  std::lock_guard<std::mutex> g(gate_);
  bool closed;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!failure_) failure_ = e;
    closed = closed_;
  }
  if (!closed) target_->abort(src);
  std::lock_guard<std::mutex> l(mu_);
  drop_queue_locked(src);
  cv_.notify_all();
}

}  // namespace linkwise
