// DeferWorkers: the helper threads of the GPU plane's deferred receives (the Python side is
// linkwise/cuda/deferred.py, the engine's side csrc/cuda/p2p_defer.cu).
//
// A deferred receive waits on the host for its sender's buffer description (a host message)
// and then has the engine enqueue the copy (GpuEngine::recv_defer_finish). These threads are
// native so that neither step needs the GIL: with Python helper threads a receive posted
// before its send started its copy up to a few sys.getswitchinterval() (5 ms each) late
// while the caller ran Python (docs/benchmarks.md, thirty-fifth and thirty-sixth sessions).
//
// Threading. post / busy / failed / rethrow / reap run on the communicator's caller thread
// with the GIL; close (and the destructor) may block and are called with the GIL released
// (the binding does that). One thread per source, started on its first post, serves that
// source's queue in order and never touches Python: it waits on the description's host
// request (its own shared_ptr) and calls the target. `mu_` guards the queues, pending counts,
// the current requests, failure_ and closed_; `gate_` is held around every target call that
// enqueues or aborts, so close() can wait for one in progress, and after close() returns no
// thread calls the target (close joins them).
//
// Ownership. Each item holds references to Python objects (the user's array, the message
// buffer the description lands in, the host request) taken with the GIL at post; a thread
// that is done with an item moves them to `retired_`, and the caller thread drops them with
// the GIL (reap, called by post / busy / close / the destructor). The description buffer is
// therefore alive for as long as a thread may read it.
#pragma once

#include <Python.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "p2p/request.h"
#include "core/process_local.h"

namespace linkwise {

class NativeComm;

// What the threads drive: the GPU engine (bind_defer.cc), or a recording fake for tests.
// Any thread; finish and abort are called under the workers' gate.
class DeferTarget {
 public:
  virtual ~DeferTarget() = default;
  // Enqueues the receive of nbytes at x from src; takes `event` (recv_defer_finish). desc:
  // the sender's description, empty for the scratch receive.
  virtual void finish(uintptr_t event, uintptr_t x, size_t nbytes, int src, const std::string& desc) = 0;
  // Releases an event that finish will never take.
  virtual void drop(uintptr_t event) = 0;
  // Stops every device wait of the communicator, naming src (-1: none).
  virtual void abort(int src) = 0;
};

class DeferWorkers {
 public:
  // `target` outlives this object (the binding keeps its Python object referenced).
  DeferWorkers(DeferTarget* target, int nranks);
  ~DeferWorkers();  // close(0) and reap: call with the GIL released for the close part
  DeferWorkers(const DeferWorkers&) = delete;
  DeferWorkers& operator=(const DeferWorkers&) = delete;

  struct Item {
    int src = -1;
    std::shared_ptr<NativeComm> comm;  // with req: the host request of the description
    std::shared_ptr<Request> req;      // null: no description (the scratch receive)
    double timeout_s = 0;
    const uint8_t* msg = nullptr;      // 1 flag byte + desc_bytes, filled by req
    size_t desc_bytes = 0;
    uintptr_t event = 0, x = 0;
    size_t nbytes = 0;
    PyObject* held[3] = {nullptr, nullptr, nullptr};  // new references, dropped by reap
  };
  // Queues `item` for its source (GIL held: the item's references are already taken).
  // Throws the recorded failure (and keeps nothing) if one happened, Invalid once closed.
  void post(Item item);
  bool busy(int src);
  bool failed();
  void rethrow();  // throws the recorded failure; nothing if none
  // Lets queued receives finish for up to timeout_s, then stops: withdraws the host requests
  // still waiting, aborts the target when receives were left, joins the threads. Idempotent.
  // GIL released.
  void close(double timeout_s);
  // Drops the Python references of finished items. GIL held.
  void reap();

 private:
  void serve(int src);
  void fail(int src, std::exception_ptr e);
  void drop_queue_locked(int src);
  void retire_locked(Item& item);

  DeferTarget* const target_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::mutex gate_;
  std::vector<std::deque<Item>> queues_;
  std::vector<int> pending_;  // posted, not yet enqueued or dropped
  std::vector<Item*> current_;  // the item a thread waits on (its request may be withdrawn)
  std::vector<OwnedThread> threads_;  // joined only by the process that started them
  std::vector<PyObject*> retired_;
  std::exception_ptr failure_;
  // Set under mu_; read under mu_ or, by a thread about to call the target, under gate_
  // (close sets it before it takes gate_, so a thread that takes gate_ after sees it).
  std::atomic<bool> closed_{false};
};

}  // namespace linkwise
