// Python bindings of the CPU collectives.
//
//   coll(native, kind, x, out, dtype, op, root, seq, algo, chunk, order, parent, children, timeout)
//       runs one collective on the calling thread with the GIL released;
//   CollWorker(native).submit(...same...) runs it on the communicator's worker thread and
//       returns a CollRequest (wait(timeout), test(), fileno() -> eventfd, done).
//
// Ownership: a CollRequest holds both arrays (buffer acquired, object referenced) until the
// job is done; dropped early, it leaks them rather than let the worker touch freed memory.
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
#include "bindings/native_comm.h"

namespace nb = nanobind;

namespace linkwise {

namespace {

// The shared-memory fast path of one communicator (see algo/shm_coll.h). A failure aborts
// the communicator's engine too, as a failed p2p collective does. Made by make_shared (as
// NativeComm), so shared_from_this() is owned from C++ alone (no Python reference inside): the
// async worker may drop the last reference without the GIL, also at interpreter shutdown.
class PyShmColl : public std::enable_shared_from_this<PyShmColl> {
 public:
  PyShmColl(std::shared_ptr<NativeComm> comm, const std::string& name, bool create, double spin_us)
      : comm_(std::move(comm)),
        shm_(name, create, comm_->engine().rank(), comm_->engine().size(), spin_us) {
    // A point-to-point collective that fails (here or, by notice, on a peer) stops this
    // executor too: a peer may be waiting here for a call this rank will never make.
    comm_->engine().set_failure_hook([this](int blame) {
      if (blame >= 0) shm_.stop_for_peer(blame);
      else shm_.stop();
    });
  }
  ~PyShmColl() { comm_->engine().set_failure_hook(nullptr); }  // the engine outlives us (comm_)
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (const Error& e) {
      // The point-to-point collectives stop too, here and (by notice) on the peers, so none
      // waits for this rank until the timeout. The failure hook only re-marks this executor.
      comm_->engine().abort_and_notify("a shared-memory collective failed on this rank",
                                       e.kind() == ErrorKind::Peer ? e.peer() : -1);
      throw;
    }
  }
  std::shared_ptr<NativeComm> comm_;
  ShmColl shm_;
};

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

// Acquires x (read) and out (write); either may be None. Returns (send, bytes, recv, bytes).
void hold(nb::handle x, nb::handle out, HeldBuffer& hx, HeldBuffer& ho, const void*& s, size_t& sb, void*& r,
          size_t& rb) {
  if (!x.is_none()) {
    acquire_buffer(x, false, "collective input", hx, true);
    s = hx.ptr();
    sb = hx.bytes();
  }
  if (!out.is_none()) {
    acquire_buffer(out, true, "collective output", ho, true);
    r = ho.ptr();
    rb = ho.bytes();
  }
}

class CollRequest {
 public:
  CollRequest(std::shared_ptr<NativeComm> comm, std::shared_ptr<CollJob> job, nb::object x, nb::object out)
      : comm_(std::move(comm)), job_(std::move(job)), x_(std::move(x)), out_(std::move(out)) {}
  ~CollRequest() {  // runs under the GIL (a Python object's destructor)
    if (job_->done.load(std::memory_order_acquire)) {
      // Never waited for: release the buffers here, not in ~CollJob, which may run on the
      // worker thread without the GIL.
      job_->x.release();
      job_->out.release();
    } else {
      // The worker may still read or write these arrays: keep them for good.
      job_->x.held = false;
      job_->out.held = false;
      x_.release();
      out_.release();
    }
  }
  void wait(double timeout_s) {
    {
      nb::gil_scoped_release nogil;
      std::unique_lock<std::mutex> l(job_->mu);
      if (!job_->cv.wait_for(l, std::chrono::duration<double>(timeout_s), [&] { return job_->done.load(); }))
        throw Error(ErrorKind::Timeout, "async collective did not complete within " + seconds_text(timeout_s) +
                                            "; check that every rank calls it, or raise LINKWISE_TIMEOUT");
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
};

void run_shm(CollJob& j);

// The shared-memory all-reduce reads x while it writes out (the peers' too, at once), so an
// out that partly overlaps x (not x itself) would corrupt inputs still to be read (wrong sums
// from ~30000 elements). Such an x is read from a copy instead, staged here (`staged` keeps
// it), as the message-based algorithms copy x into out first. Returns the input to use.
// (The executor's broadcast handles an overlapping out itself: test_coll_bcast_out.py.)
const void* unoverlapped_input(const void* x, size_t x_bytes, const void* out, size_t out_bytes,
                               std::vector<char>& staged) {
  const char* a = static_cast<const char*>(x);
  const char* b = static_cast<const char*>(out);
  if (a == b || a >= b + out_bytes || b >= a + x_bytes) return x;
  staged.assign(a, a + x_bytes);
  return staged.data();
}

// The executor's kind for a small all_gather / reduce_scatter / all_to_all, after checking
// that out has the size that kind needs for in_bytes of x (ValueError, as the general path).
ShmColl::CallKind exchange_kind(CollKind kind, size_t in_bytes, size_t out_bytes, const ShmColl& shm) {
  const size_t n = static_cast<size_t>(shm.size());
  switch (kind) {
    case CollKind::AllGather:
      if (out_bytes != in_bytes * n) throw Error(ErrorKind::Invalid, "all_gather: out must have size * len(x) elements");
      return ShmColl::kAllGather;
    case CollKind::ReduceScatter:
      if (out_bytes * n != in_bytes) throw Error(ErrorKind::Invalid, "reduce_scatter: x must have size * len(out) elements");
      return ShmColl::kReduceScatter;
    case CollKind::AllToAll:
      if (out_bytes != in_bytes || in_bytes % n)
        throw Error(ErrorKind::Invalid, "all_to_all: x and out need the same size, a multiple of the communicator size");
      return ShmColl::kAllToAll;
    default:
      throw Error(ErrorKind::Invalid, "the shared-memory executor runs all_reduce, broadcast, all_gather, "
                                      "reduce_scatter and all_to_all only");
  }
}

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
      thread_.join();
    }
  }
  // Jobs submitted and not finished. The submitting thread reads it to keep collectives in
  // issue order: a blocking call runs inline only when no async one is pending.
  int pending() const { return pending_.load(); }
  void submit(std::shared_ptr<CollJob> job) {
    pending_.fetch_add(1);
    std::lock_guard<std::mutex> g(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { main(); });
    queue_.push_back(std::move(job));
    cv_.notify_all();
  }
  std::shared_ptr<NativeComm> comm() { return comm_; }

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
  std::thread thread_;
  bool stop_ = false;
  std::atomic<int> pending_{0};
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
    else
      j.shm->shm_.exchange(exchange_kind(j.p.kind, j.send_bytes, j.recv_bytes, j.shm->shm_), j.send, j.send_bytes,
                           j.recv, j.p.dtype, j.p.op, j.p.timeout);
  });
}

}  // namespace

void bind_coll(nb::module_& m) {
  nb::class_<PyShmColl>(m, "ShmColl", "Shared-memory collectives of a single-host communicator.")
      .def(nb::new_([](NativeComm& c, const std::string& name, bool create, double spin_us) {
             return std::make_shared<PyShmColl>(c.shared_from_this(), name, create, spin_us);
           }),
           nb::arg("native"), nb::arg("name"), nb::arg("create"), nb::arg("spin_us"))
      .def("connect",
           [](PyShmColl& s, double timeout, bool cma, size_t ar_min, size_t bc_min, size_t chunk, size_t piece,
              size_t lane_min, int threads, size_t one_max) {
             ShmCollOptions o;
             o.enable = cma;
             o.ar_min = ar_min;
             o.bc_min = bc_min;
             o.chunk = chunk;
             o.piece = piece;
             o.lane_min = lane_min;
             o.threads = threads;
             o.one_max = one_max;
             nb::gil_scoped_release nogil;  // waits for every rank (a barrier through the segment)
             s.guarded([&] { s.shm_.connect(o, timeout); });
           },
           nb::arg("timeout"), nb::arg("cma"), nb::arg("ar_min"), nb::arg("bc_min"), nb::arg("chunk"),
           nb::arg("piece"), nb::arg("lane_min"), nb::arg("threads"), nb::arg("one_max"),
           "Learn the peers, probe single-copy (CMA) access, agree on its use with every rank.")
      .def_prop_ro("cma", [](PyShmColl& s) { return s.shm_.cma(); },
                   "True when large all_reduce/broadcast copy directly between ranks' buffers (CMA).")
      .def_prop_ro("cma_bcast_min", [](PyShmColl& s) { return s.shm_.cma_bcast_min(); },
                   "Broadcasts of at least this many bytes take the CMA path (agreed by all ranks).")
      .def_prop_ro("cma_calls",
                   [](PyShmColl& s) { return std::make_pair(s.shm_.cma_all_reduces(), s.shm_.cma_broadcasts()); },
                   "(all_reduces, broadcasts) that took the CMA path so far.")
      .def_prop_ro("lane_calls",
                   [](PyShmColl& s) { return std::make_pair(s.shm_.lane_all_reduces(), s.shm_.lane_broadcasts()); },
                   "(all_reduces, broadcasts) that ran on several lanes (helper threads) so far.")
      .def_prop_ro("one_shot_max", [](PyShmColl& s) { return s.shm_.one_shot_max(); },
                   "Largest all_reduce (bytes) that runs one-shot (rank 0's setting, agreed by all ranks).")
      .def_prop_ro("max_lanes", [](PyShmColl& s) { return s.shm_.max_lanes(); },
                   "Most lanes a message is cut into (rank 0's threads, at most 16; agreed by all ranks).")
      .def("unlink", [](PyShmColl& s) { s.shm_.unlink(); })
      .def("skip_call", [](PyShmColl& s) { s.shm_.skip_call(); },
           "a collective refused its arguments on this rank: number the calls as if it had run")
      .def("stop", [](PyShmColl& s) { s.shm_.stop(); },
           "after another collective of the communicator failed here: peers waiting in this "
           "executor give up, and every later call on every rank raises")
      .def_prop_ro("segment_name", [](PyShmColl& s) { return s.shm_.segment_name(); })
      .def("all_reduce",
           [](PyShmColl& s, nb::handle x, nb::handle out, int code, double timeout) {
             // code = dtype * 8 + op, validated by the caller for x's dtype; out may be x (in
             // place). Every check of out (same dtype and size as x, writable, contiguous)
             // happens here, with the messages of the general path.
             HeldBuffer hx, ho;
             const bool in_place = out.is(x);
             acquire_buffer(x, in_place, "all_reduce", hx, true);
             void* o = const_cast<void*>(hx.ptr());
             const void* in = hx.ptr();
             std::vector<char> staged;  // x, when out partly overlaps it
             if (!in_place) {
               acquire_buffer(out, true, "all_reduce", ho, true);
               if (ho.bytes() != hx.bytes() || ho.dtype() != hx.dtype()) {
                 const size_t xs = hx.view.itemsize, os = ho.view.itemsize;
                 throw nb::value_error(("all_reduce: out must be a " + dtype_name(hx.dtype()) + " array of " +
                                        std::to_string(hx.bytes() / (xs ? xs : 1)) + " elements, got " +
                                        dtype_name(ho.dtype()) + " with " + std::to_string(ho.bytes() / (os ? os : 1)))
                                           .c_str());
               }
               o = ho.ptr();
               in = unoverlapped_input(in, hx.bytes(), o, ho.bytes(), staged);
             }
             const DType t = static_cast<DType>(code >> 3);
             const size_t count = hx.bytes() / dtype_size(t);
             const RedOp rop = static_cast<RedOp>(code & 7);
             // Small messages start with the GIL held (releasing and retaking it cost ~0.1 us
             // of a ~2 us call in a same-build A/B, docs/benchmarks.md): done when the peers
             // were already there (a bounded spin), else the wait goes on without the GIL, so
             // other threads run meanwhile.
             int started = -1;
             s.guarded([&] { started = s.shm_.all_reduce_start(in, o, count, t, rop, timeout); });
             if (started == 1) return;
             nb::gil_scoped_release nogil;
             if (started == 0) s.guarded([&] { s.shm_.all_reduce_finish(o, count, t, rop); });
             else s.guarded([&] { s.shm_.all_reduce(in, o, count, t, rop, timeout); });
           },
           nb::arg("x"), nb::arg("out"), nb::arg("code"), nb::arg("timeout"))
      .def("broadcast",
           [](PyShmColl& s, nb::handle buf, int root, double timeout, nb::handle src) {
             // src: the root's source (None: buf itself, in place), as many bytes as buf.
             HeldBuffer hb, hs;
             acquire_buffer(buf, true, "broadcast", hb, true);
             const void* from = hb.ptr();
             if (!src.is_none() && !src.is(buf)) {
               acquire_buffer(src, false, "broadcast", hs, true);
               if (hs.bytes() != hb.bytes()) throw nb::value_error("broadcast: out must have as many bytes as x");
               from = hs.ptr();
             }
             nb::gil_scoped_release nogil;
             s.guarded([&] { s.shm_.broadcast(from, hb.ptr(), hb.bytes(), root, timeout); });
           },
           nb::arg("buf"), nb::arg("root"), nb::arg("timeout"), nb::arg("src").none() = nb::none())
      .def("exchange",
           [](PyShmColl& s, int kind, nb::handle x, nb::handle out, int code, double timeout) {
             // kind: a CollKind code (all_gather, reduce_scatter, all_to_all); code = dtype * 8
             // + op (reduce_scatter; validated by the caller for x's dtype). out may be x.
             HeldBuffer hx, ho;
             const void* send = nullptr;
             size_t sb = 0, rb = 0;
             void* recv = nullptr;
             hold(x, out, hx, ho, send, sb, recv, rb);
             const ShmColl::CallKind k = exchange_kind(static_cast<CollKind>(kind), sb, rb, s.shm_);
             nb::gil_scoped_release nogil;
             s.guarded([&] {
               s.shm_.exchange(k, send, sb, recv, static_cast<DType>(code >> 3), static_cast<RedOp>(code & 7), timeout);
             });
           },
           nb::arg("kind"), nb::arg("x"), nb::arg("out"), nb::arg("code"), nb::arg("timeout"),
           "A small all_gather, reduce_scatter or all_to_all (x of at most 32 KiB, ShmColl::kOneMax).");

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
      .def("wait", &CollRequest::wait, nb::arg("timeout"))
      .def("test", &CollRequest::test)
      .def("fileno", &CollRequest::fileno, "An eventfd that turns readable when the collective is done.")
      .def_prop_ro("done", &CollRequest::done)
      .def_prop_ro("nbytes", [](CollRequest&) { return 0; });

  nb::class_<CollWorker>(m, "CollWorker", "The worker thread that runs a communicator's async collectives.")
      .def(nb::new_([](NativeComm& c) { return std::make_shared<CollWorker>(c.shared_from_this()); }),
           nb::arg("native"))
      .def("submit",
           [](CollWorker& w, int kind, nb::object x, nb::object out, int dtype, int op, int root, uint64_t seq,
              int algo, size_t chunk, std::vector<int> order, int parent, std::vector<int> children, double timeout,
              PyShmColl* shm) {
             auto job = std::make_shared<CollJob>();
             if (shm) job->shm = shm->shared_from_this();  // C++-owned, not nanobind's py_deleter
             job->p = make_params(kind, dtype, op, root, seq, algo, chunk, std::move(order), parent,
                                  std::move(children), timeout);
             hold(x, out, job->x, job->out, job->send, job->send_bytes, job->recv, job->recv_bytes);
             if (shm && job->send && job->recv && job->p.kind == CollKind::AllReduce)
               job->send = unoverlapped_input(job->send, job->send_bytes, job->recv, job->recv_bytes, job->staged);
             auto req = std::make_unique<CollRequest>(w.comm(), job, x, out);
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
      .def_prop_ro("pending", &CollWorker::pending);
}

}  // namespace linkwise
