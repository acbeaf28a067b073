// NativeComm: the native side of one Python Communicator (engine + its transports), and
// PyRequest, a Request that holds its Python array. Shared by the bind_*.cc files.
//
// Ownership: a PyRequest keeps its NativeComm alive; the array stays acquired until done (a
// request dropped before then hands it to the NativeComm's DroppedRequests, dropped_requests.h).
#pragma once

#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "bindings/buffer.h"
#include "bindings/dropped_requests.h"
#include "core/wait.h"
#include "p2p/engine.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace linkwise {

namespace nb = nanobind;

class NativeComm;

class PyRequest {
 public:
  PyRequest(std::shared_ptr<NativeComm> comm, std::shared_ptr<Request> req, nb::object owner, double timeout_s)
      : timeout(timeout_s), comm_(std::move(comm)), req_(std::move(req)), owner_(std::move(owner)) {}
  ~PyRequest();
  // The bytes moved. named_s: the timeout a TimeoutError names (wait_all's whole budget, of
  // which timeout_s is what is left); below 0: timeout_s.
  size_t wait(double timeout_s, double named_s = -1.0);
  // wait() in two halves, for wait_all: wait_nogil without the GIL (throws the request's
  // error), then let_go with it (lets the array go once done).
  void wait_nogil(double timeout_s, double named_s = -1.0);
  void let_go() {
    if (req_->done()) buf_.release();
  }
  bool test();
  int fileno() { return req_->event_fd(); }
  size_t nbytes() const { return req_->transferred(); }
  bool done() const { return req_->done(); }
  // The engine's progress thread drives it (posted async and not done at once); set under the
  // engine's lock before post() returned, never changed after.
  bool driven() const { return req_->is_async; }
  HeldBuffer& buffer() { return buf_; }
  // For threads that wait on it without Python (DeferWorkers): the engine and the request.
  const std::shared_ptr<NativeComm>& native_comm() const { return comm_; }
  const std::shared_ptr<Request>& request() const { return req_; }
  // Seconds wait() and await give it when not told otherwise (the communicator's timeout, or
  // the isend/irecv timeout= argument).
  double timeout;

 private:
  std::shared_ptr<NativeComm> comm_;
  std::shared_ptr<Request> req_;
  nb::object owner_;
  HeldBuffer buf_;
};

// A send / receive request dropped while its bytes were moving (too late to withdraw: the
// engine finishes it), with its array: let go once the request is done, at the next post,
// blocking call or close of the communicator (NativeComm's DroppedRequests; contract there).
struct DroppedTransfer {
  std::shared_ptr<Request> req;
  std::unique_ptr<HeldBuffer> buf;  // HeldBuffer itself does not move
  nb::object owner;
  bool done() const { return req->done(); }
  void let_go() { buf->release(); }
  void keep_for_good() {
    buf->held = false;
    owner.release();
  }
};

class NativeComm : public std::enable_shared_from_this<NativeComm> {
 public:
  NativeComm(int rank, int size, double spin_us, size_t pull_threshold)
      : engine_(rank, size, EngineOptions{spin_us, pull_threshold}) {}

  void create_shm_inbox(const std::string& name, size_t ring_bytes) {
    LW_CHECK(!shm_, "one shared-memory inbox per communicator");
    shm_ = std::make_shared<ShmTransport>(name, engine_.rank(), engine_.size(), ring_bytes);
    engine_.add_transport(shm_);
  }
  void connect_shm(int peer, const std::string& name, int64_t pid) {
    LW_CHECK(shm_, "create_shm_inbox before connect_shm");
    engine_.set_link(peer, shm_->connect(peer, name, pid), shm_.get());
  }
  std::string shm_inbox_name() const { return shm_ ? shm_->inbox_name() : std::string(); }
  void unlink_shm() {
    if (shm_) shm_->unlink_name();
  }
  void adopt_tcp(int peer, int fd) {
    if (!tcp_) {
      tcp_ = std::make_shared<TcpTransport>();
      engine_.add_transport(tcp_);
    }
    engine_.set_link(peer, tcp_->adopt(peer, fd), tcp_.get());
  }

  std::unique_ptr<PyRequest> post(nb::handle obj, int peer, uint64_t tag, bool is_send, bool is_async,
                                  double timeout_s) {
    dropped_.reap();
    check_user_timeout(timeout_s, is_send ? "isend" : "irecv");
    HeldBuffer held;  // moved into the PyRequest below; released here if posting throws
    acquire_buffer(obj, !is_send, is_send ? "send" : "recv", held, true);
    std::shared_ptr<Request> req =
        is_send ? engine_.isend(peer, held.ptr(), held.bytes(), tag, held.dtype(), is_async)
                : engine_.irecv(peer, held.ptr(), held.bytes(), tag, held.dtype(), is_async);
    auto py = std::make_unique<PyRequest>(shared_from_this(), std::move(req), nb::borrow(obj), timeout_s);
    std::swap(py->buffer().view, held.view);
    py->buffer().held = held.held;
    held.held = false;
    return py;
  }

  // Blocking send/recv: no Request object crosses into Python (the latency path).
  size_t blocking(nb::handle obj, int peer, uint64_t tag, bool is_send, double timeout_s) {
    dropped_.reap();
    check_user_timeout(timeout_s, is_send ? "send" : "recv");
    HeldBuffer held;
    acquire_buffer(obj, !is_send, is_send ? "send" : "recv", held, true);
    std::shared_ptr<Request> req;
    {
      nb::gil_scoped_release nogil;
      req = is_send ? engine_.isend(peer, held.ptr(), held.bytes(), tag, held.dtype(), false)
                    : engine_.irecv(peer, held.ptr(), held.bytes(), tag, held.dtype(), false);
      engine_.wait(*req, timeout_s, is_send ? "send" : "recv");
    }
    return req->transferred();
  }

  // Blocking exchange (MPI_Sendrecv): receives from src into recv_obj while sending send_obj
  // to dst, in one call without the GIL; returns the bytes received. Each wait has timeout_s.
  size_t sendrecv(nb::handle send_obj, int dst, uint64_t send_tag, nb::handle recv_obj, int src,
                  uint64_t recv_tag, double timeout_s) {
    check_user_timeout(timeout_s, "sendrecv");
    HeldBuffer hs, hr;
    acquire_buffer(send_obj, false, "sendrecv", hs, true);
    acquire_buffer(recv_obj, true, "sendrecv", hr, true);
    const char* sp = static_cast<const char*>(hs.ptr());
    const char* rp = static_cast<const char*>(hr.ptr());
    if (hs.bytes() && hr.bytes() && sp < rp + hr.bytes() && rp < sp + hs.bytes())
      throw Error(ErrorKind::Invalid,
                  "sendrecv: x and out share memory; the receive would overwrite x while it is sent. "
                  "Send a copy, or call sendrecv_replace (out is never x, as in MPI_Sendrecv)");
    nb::gil_scoped_release nogil;
    return exchange(hs.ptr(), hs.bytes(), hs.dtype(), dst, send_tag, hr, src, recv_tag, timeout_s);
  }

  // Blocking exchange in one buffer (MPI_Sendrecv_replace): sends a copy of obj's bytes to dst
  // while receiving into obj from src; returns the bytes received. The copy goes to scratch_,
  // kept between calls up to kScratchKeep bytes (a repeated exchange then does not fault in
  // fresh pages each time), or to memory of its own while another thread's exchange holds it.
  // The copy starts at obj's offset within a page: copies between buffers a few bytes apart
  // modulo 4 KiB run several times slower (docs/benchmarks.md, fourteenth session).
  size_t sendrecv_replace(nb::handle obj, int dst, uint64_t send_tag, int src, uint64_t recv_tag,
                          double timeout_s) {
    check_user_timeout(timeout_s, "sendrecv_replace");
    HeldBuffer h;
    acquire_buffer(obj, true, "sendrecv_replace", h, true);
    nb::gil_scoped_release nogil;
    const size_t offset = reinterpret_cast<uintptr_t>(h.ptr()) & (kPage - 1);
    const size_t need = offset + h.bytes();
    std::unique_lock<std::mutex> hold(scratch_mu_, std::try_to_lock);
    PageMemory own;
    char* base;
    if (hold.owns_lock() && need <= kScratchKeep) {
      if (scratch_bytes_ < need || !scratch_) {
        scratch_ = page_memory(need);
        scratch_bytes_ = need;
      }
      base = scratch_.get();
    } else {
      own = page_memory(need);
      base = own.get();
    }
    std::memcpy(base + offset, h.ptr(), h.bytes());
    return exchange(base + offset, h.bytes(), h.dtype(), dst, send_tag, h, src, recv_tag, timeout_s);
  }

  Engine& engine() { return engine_; }

  // A PyRequest dropped while req moves bytes (not withdrawable) hands its array here (under
  // the GIL); see DroppedRequests.
  void keep_dropped(std::shared_ptr<Request> req, HeldBuffer& buf, nb::object owner) {
    auto held = std::make_unique<HeldBuffer>();
    std::swap(held->view, buf.view);
    held->held = buf.held;
    buf.held = false;
    dropped_.keep({std::move(req), std::move(held), std::move(owner)});
  }
  // Lets go of the dropped requests' arrays whose request is done (under the GIL).
  void reap_dropped() { dropped_.reap(); }

 private:
  static constexpr size_t kScratchKeep = size_t{16} << 20;  // larger copies: memory of their own each call
  static constexpr size_t kPage = 4096;
  struct FreeMemory {
    void operator()(char* p) const { std::free(p); }
  };
  using PageMemory = std::unique_ptr<char, FreeMemory>;
  static PageMemory page_memory(size_t bytes) {
    const size_t rounded = (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
    char* p = static_cast<char*>(std::aligned_alloc(kPage, rounded));
    if (!p) throw std::bad_alloc();
    return PageMemory(p);
  }

  // The two halves of sendrecv, without the GIL: the receive into hr posted first, then the
  // send of [sp, sp + sbytes); each wait has timeout_s. If the send fails, the receive is
  // withdrawn before the buffers are let go: cancelled if no byte moved yet, else the engine
  // aborts (its copies stop with it, under the engine's lock).
  size_t exchange(const void* sp, size_t sbytes, uint32_t sdtype, int dst, uint64_t send_tag, HeldBuffer& hr,
                  int src, uint64_t recv_tag, double timeout_s) {
    std::shared_ptr<Request> r = engine_.irecv(src, hr.ptr(), hr.bytes(), recv_tag, hr.dtype(), false);
    std::shared_ptr<Request> s;
    try {
      s = engine_.isend(dst, sp, sbytes, send_tag, sdtype, false);
      engine_.wait(*s, timeout_s, "send");
    } catch (...) {
      if (!engine_.cancel(*r) && !r->done()) engine_.abort_and_notify("a sendrecv's send failed while its receive was moving bytes", -1,
                                 engine_.next_collective());
      throw;
    }
    engine_.wait(*r, timeout_s, "recv");
    return r->transferred();
  }

  // Before engine_, so destroyed after it (the engine moves no bytes then); the arrays of
  // requests still not done are kept for good there (a peer may be copying from them).
  DroppedRequests<DroppedTransfer> dropped_;
  Engine engine_;
  std::mutex scratch_mu_;  // held by the sendrecv_replace that copies into scratch_
  PageMemory scratch_;
  size_t scratch_bytes_ = 0;
  std::shared_ptr<ShmTransport> shm_;
  std::shared_ptr<TcpTransport> tcp_;
};

}  // namespace linkwise
