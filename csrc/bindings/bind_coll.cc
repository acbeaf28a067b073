// Python bindings of the CPU collectives.
//
//   coll(native, kind, x, out, dtype, op, root, seq, algo, chunk, order, parent, children, timeout)
//       runs one collective on the calling thread with the GIL released;
//   CollWorker(native).submit(...same...) runs it on the communicator's worker thread and
//       returns a CollRequest (wait(timeout), test(), fileno() -> eventfd, done).
//
// Ownership: a CollRequest holds both arrays (buffer acquired, object referenced) until the
// job is done; dropped early, it hands them to its worker's Orphans, which lets them go once
// the job is done (never while the worker may still touch them).
// Threading: one worker thread per CollWorker runs jobs in submission order (FIFO), so async
// collectives of one communicator start in the order they were called on this rank. The
// worker never touches Python objects; buffers are released by wait()/test() under the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "algo/coll.h"
#include "algo/shm_coll.h"
#include "bindings/bindings.h"
#include "bindings/dropped_requests.h"
#include "bindings/native_comm.h"
#include "bindings/shm_coll_py.h"
#include "core/wait.h"
#include "core/process_local.h"

namespace nb = nanobind;

namespace linkwise {

namespace {

// Threading: built and submitted under the GIL; then the worker runs it and may hold the last
// reference. So nothing here may need the GIL to be destroyed: the buffers are released by
// the CollRequest (under the GIL) before the job can be dropped elsewhere, or leaked.
struct CollJob {
  CollParams p;
  bool skip = false;               // shm->skip_call() only (a call refused on this rank)
  std::shared_ptr<PyShmColl> shm;  // from shared_from_this(); set: run p.kind (AllReduce/Broadcast) through shared memory
  HeldBuffer x, out;
  std::vector<char> staged;  // a copy of x that send points to, when out partly overlaps x
  const void* send = nullptr;
  size_t send_bytes = 0;
  void* recv = nullptr;
  size_t recv_bytes = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> done{false};
  std::exception_ptr err;
  // An eventfd made on the first fileno() (asyncio waits on it), not per job: thousands of
  // pending async calls waited for with wait() once ran out of file descriptors. Guarded by mu.
  int efd = -1;
  ~CollJob() {
    if (efd >= 0) ::close(efd);
  }
  void finish(std::exception_ptr e) {
    int fd;
    {
      std::lock_guard<std::mutex> g(mu);
      err = e;
      done.store(true, std::memory_order_release);
      fd = efd;
    }
    cv.notify_all();
    signal(fd);  // the job outlives this call (the worker holds it), so fd is still open
  }
  // The eventfd, made now if need be (under mu); readable once the job is done.
  int event_fd() {
    std::lock_guard<std::mutex> g(mu);
    if (efd < 0) {
      efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
      if (efd < 0) fail_errno("eventfd for an async collective");
      if (done.load(std::memory_order_relaxed)) signal(efd);
    }
    return efd;
  }
  static void signal(int fd) {
    uint64_t one = 1;
    if (fd >= 0) (void)!::write(fd, &one, sizeof one);
  }
};

CollParams make_params(int kind, int dtype, int op, int root, uint64_t seq, int algo, size_t chunk,
                       std::vector<int> order, int parent, std::vector<int> children, double timeout) {
  if (kind < 0 || kind >= static_cast<int>(CollKind::kCount)) throw Error(ErrorKind::Invalid, "collective kind out of range");
  if (dtype < 0 || dtype >= static_cast<int>(DType::kCount)) throw Error(ErrorKind::Invalid, "dtype code out of range");
  if (op < 0 || op >= static_cast<int>(RedOp::kCount)) throw Error(ErrorKind::Invalid, "reduction op code out of range");
  CollParams p;
  p.kind = static_cast<CollKind>(kind);
  p.dtype = static_cast<DType>(dtype);
  p.op = static_cast<RedOp>(op);
  p.root = root;
  p.seq = seq;
  p.algo = static_cast<Algo>(algo);
  p.chunk_bytes = chunk ? chunk : 1;
  p.order = std::move(order);
  p.parent = parent;
  p.children = std::move(children);
  p.timeout = timeout;
  return p;
}

// An async collective's request dropped while its job was pending (fire and forget:
// `comm.all_reduce(x, async_op=True)` with the request unkept), whose arrays the worker may
// still read or write. Its worker's Orphans hold it (contract in dropped_requests.h), reaped
// where the worker is used (CollWorker's submit and pending, which every collective after an
// async one reads) and when the worker ends. Orphans are touched under the GIL only, and
// dropped under it (CollWorker and CollRequest, their holders, are Python objects), so their
// destructor always lets the done ones go.
struct OrphanedJob {
  std::shared_ptr<CollJob> job;
  nb::object x, out;
  bool done() const { return job->done.load(std::memory_order_acquire); }
  void let_go() {  // here, under the GIL, not in ~CollJob, which may run on the worker thread
    job->x.release();
    job->out.release();
  }
  void keep_for_good() {  // still running (the worker outlived its Python object)
    job->x.held = false;
    job->out.held = false;
    x.release();
    out.release();
  }
};
using Orphans = DroppedRequests<OrphanedJob>;

class CollRequest {
 public:
  CollRequest(std::shared_ptr<NativeComm> comm, std::shared_ptr<CollJob> job, nb::object x, nb::object out,
              std::shared_ptr<Orphans> orphans)
      : comm_(std::move(comm)), job_(std::move(job)), x_(std::move(x)), out_(std::move(out)),
        orphans_(std::move(orphans)) {}
  ~CollRequest() {  // runs under the GIL (a Python object's destructor)
    if (job_->done.load(std::memory_order_acquire)) {
      // Never waited for: release the buffers here, not in ~CollJob, which may run on the
      // worker thread without the GIL.
      job_->x.release();
      job_->out.release();
    } else {
      // The worker may still read or write these arrays: its orphans keep them until it is done.
      orphans_->keep({job_, std::move(x_), std::move(out_)});
    }
  }
  // named_s: the timeout a TimeoutError names (wait_all's whole budget, of which timeout_s is
  // what is left); below 0: timeout_s.
  void wait(double timeout_s, double named_s = -1.0) {
    check_timeout(timeout_s, "an async collective's wait");
    {
      nb::gil_scoped_release nogil;
      // In slices of 0.1 s, for Ctrl-C (core/wait.h; checked without job_->mu, since the check
      // takes the GIL): the job goes on in the worker, as after a timeout (the Python layer
      // stops the executor then).
      const auto t0 = Clock::now();
      while (true) {
        const double left = timeout_s - seconds_since(t0);
        {
          std::unique_lock<std::mutex> l(job_->mu);
          if (job_->cv.wait_for(l, std::chrono::duration<double>(std::clamp(left, 0.0, 0.1)),
                                [&] { return job_->done.load(); }))
            break;
        }
        if (left <= 0.1)
          throw Error(ErrorKind::Timeout, "async collective did not complete within " +
                                              seconds_text(named_s >= 0 ? named_s : timeout_s) +
                                              "; check that every rank calls it, or raise LINKWISE_TIMEOUT");
        if (interrupted()) throw_interrupted(comm_->engine().rank(), "an async collective's wait");
      }
    }
    finish();
  }
  bool test() {
    if (!job_->done.load(std::memory_order_acquire)) return false;
    finish();
    return true;
  }
  int fileno() { return job_->event_fd(); }
  bool done() const { return job_->done.load(std::memory_order_acquire); }

 private:
  void finish() {
    job_->x.release();
    job_->out.release();
    if (job_->err) std::rethrow_exception(job_->err);
  }
  std::shared_ptr<NativeComm> comm_;
  std::shared_ptr<CollJob> job_;
  nb::object x_, out_;
  std::shared_ptr<Orphans> orphans_;
};

void run_shm(CollJob& j);

class CollWorker {
 public:
  explicit CollWorker(std::shared_ptr<NativeComm> comm) : comm_(std::move(comm)) {}
  ~CollWorker() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) {
      nb::gil_scoped_release nogil;
      thread_.join();  // after every queued job ran
    }
    orphans_->reap(true);
  }
  // Jobs submitted and not finished. The submitting thread reads it to keep collectives in
  // issue order: a blocking call runs inline only when no async one is pending.
  int pending() const { return pending_.load(); }
  void submit(std::shared_ptr<CollJob> job) {
    pending_.fetch_add(1);
    std::lock_guard<std::mutex> g(mu_);
    if (!thread_.joinable()) thread_ = OwnedThread([this] { main(); });
    queue_.push_back(std::move(job));
    cv_.notify_all();
  }
  std::shared_ptr<NativeComm> comm() { return comm_; }
  // The dropped requests' arrays (see Orphans); under the GIL only.
  const std::shared_ptr<Orphans>& orphans() { return orphans_; }

 private:
  void main() {
    while (true) {
      std::shared_ptr<CollJob> job;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left to run
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr err;
      try {
        if (job->shm) run_shm(*job);
        else run_collective(comm_->engine(), job->p, job->send, job->send_bytes, job->recv, job->recv_bytes);
      } catch (...) {
        err = std::current_exception();
      }
      // Not pending once it ran, before its waiter wakes: a thread returning from wait()
      // must see 0 here, or close() would stop the executor under peers still in this call
      // and a blocking call would queue behind a job that is already done.
      pending_.fetch_sub(1);
      job->finish(err);
    }
  }
  std::shared_ptr<NativeComm> comm_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<CollJob>> queue_;
  OwnedThread thread_;  // joined only by the process that started it
  bool stop_ = false;
  std::atomic<int> pending_{0};
  std::shared_ptr<Orphans> orphans_ = std::make_shared<Orphans>();
};

void run_shm(CollJob& j) {
  if (j.skip) {
    j.shm->shm_.skip_call();
    return;
  }
  j.shm->guarded([&] {
    if (j.p.kind == CollKind::Broadcast)
      j.shm->shm_.broadcast(j.send ? j.send : j.recv, j.recv, j.recv_bytes, j.p.root, j.p.timeout);
    else if (j.p.kind == CollKind::AllReduce)
      j.shm->shm_.all_reduce(j.send, j.recv, j.send_bytes / dtype_size(j.p.dtype), j.p.dtype, j.p.op, j.p.timeout);
    else if (j.p.kind == CollKind::Reduce)  // recv: the root's output, null elsewhere
      j.shm->shm_.reduce(j.send, j.recv, j.send_bytes / dtype_size(j.p.dtype), j.p.dtype, j.p.op, j.p.root,
                         j.p.timeout);
    else if (j.p.kind == CollKind::Gather)  // recv: the root's output, null elsewhere
      j.shm->shm_.gather(j.send, j.send_bytes, j.recv, j.p.root, j.p.timeout);
    else if (j.p.kind == CollKind::Scatter)  // send: the root's input, null elsewhere
      j.shm->shm_.scatter(j.send, j.recv, j.recv_bytes, j.p.root, j.p.timeout);
    else
      j.shm->shm_.exchange(exchange_kind(j.p.kind, j.send_bytes, j.recv_bytes, j.shm->shm_), j.send, j.send_bytes,
                           j.recv, j.p.dtype, j.p.op, j.p.timeout);
  });
}

}  // namespace

void bind_coll(nb::module_& m) {
  m.def("coll",
        [](NativeComm& c, int kind, nb::handle x, nb::handle out, int dtype, int op, int root, uint64_t seq, int algo,
           size_t chunk, std::vector<int> order, int parent, std::vector<int> children, double timeout) {
          CollParams p = make_params(kind, dtype, op, root, seq, algo, chunk, std::move(order), parent,
                                     std::move(children), timeout);
          HeldBuffer hx, ho;
          const void* s = nullptr;
          size_t sb = 0, rb = 0;
          void* r = nullptr;
          hold(x, out, hx, ho, s, sb, r, rb);
          nb::gil_scoped_release nogil;
          run_collective(c.engine(), p, s, sb, r, rb);
        },
        nb::arg("native"), nb::arg("kind"), nb::arg("x").none(), nb::arg("out").none(), nb::arg("dtype"),
        nb::arg("op"), nb::arg("root"), nb::arg("seq"), nb::arg("algo"), nb::arg("chunk"), nb::arg("order"),
        nb::arg("parent"), nb::arg("children"), nb::arg("timeout"),
        "Run one collective on this thread (GIL released). See linkwise.collectives.");

  nb::class_<CollRequest>(m, "CollRequest", "An async collective; wait() or await it.")
      .def("wait", [](CollRequest& r, double timeout) { r.wait(timeout); }, nb::arg("timeout"))
      .def(
          "_wait_within", [](CollRequest& r, double left, double whole) { r.wait(std::max(0.0, left), whole); },
          nb::arg("left"), nb::arg("whole"),
          "wait() for wait_all: at most `left` seconds (0: as _wait_now), its TimeoutError naming `whole`.")
      .def("_wait_now", [](CollRequest& r) { r.wait(0.0); }, "its error if done, else TimeoutError (it goes on)")
      .def("test", &CollRequest::test)
      .def("fileno", &CollRequest::fileno, "An eventfd that turns readable when the collective is done.")
      .def_prop_ro("done", &CollRequest::done)
      .def_prop_ro("nbytes", [](CollRequest&) { return 0; });

  nb::class_<CollWorker>(m, "CollWorker", "The worker thread that runs a communicator's async collectives.")
      .def(nb::new_([](NativeComm& c) { return make_process_local<CollWorker>(c.shared_from_this()); }),
           nb::arg("native"))
      .def("submit",
           [](CollWorker& w, int kind, nb::object x, nb::object out, int dtype, int op, int root, uint64_t seq,
              int algo, size_t chunk, std::vector<int> order, int parent, std::vector<int> children, double timeout,
              PyShmColl* shm) {
             w.orphans()->reap();
             auto job = std::make_shared<CollJob>();
             if (shm) job->shm = shm->shared_from_this();  // C++-owned, not nanobind's py_deleter
             job->p = make_params(kind, dtype, op, root, seq, algo, chunk, std::move(order), parent,
                                  std::move(children), timeout);
             hold(x, out, job->x, job->out, job->send, job->send_bytes, job->recv, job->recv_bytes);
             if (shm && job->send && job->recv &&
                 (job->p.kind == CollKind::AllReduce || job->p.kind == CollKind::Reduce ||
                  job->p.kind == CollKind::Gather))
               job->send = unoverlapped_input(
                   job->send, job->send_bytes, job->recv, job->recv_bytes, job->staged,
                   job->p.kind == CollKind::Gather ? static_cast<char*>(job->recv) + root * job->send_bytes : nullptr);
             auto req = std::make_unique<CollRequest>(w.comm(), job, x, out, w.orphans());
             w.submit(job);
             return req;
           },
           nb::arg("kind"), nb::arg("x").none(), nb::arg("out").none(), nb::arg("dtype"), nb::arg("op"),
           nb::arg("root"), nb::arg("seq"), nb::arg("algo"), nb::arg("chunk"), nb::arg("order"), nb::arg("parent"),
           nb::arg("children"), nb::arg("timeout"), nb::arg("shm").none() = nb::none())
      .def("submit_skip",
           [](CollWorker& w, PyShmColl& shm) {
             auto job = std::make_shared<CollJob>();
             job->shm = shm.shared_from_this();
             job->skip = true;
             w.submit(job);  // nobody waits for it: it only keeps shm's call numbers in issue order
           },
           nb::arg("shm"), "shm.skip_call() in issue order, behind the pending async collectives")
      .def_prop_ro("pending",
                   [](CollWorker& w) {
                     w.orphans()->reap();  // read before every collective once async ones exist
                     return w.pending();
                   },
                   "Jobs submitted and not finished (reading it also lets go of the arrays of dropped "
                   "requests whose job is done).");
}

}  // namespace linkwise
