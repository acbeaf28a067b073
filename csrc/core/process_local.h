// Objects with threads, and fork().
//
// fork() copies a process's memory but only the forking thread. A child that destroys an
// object it inherited (Python's garbage collector freeing a communicator that was garbage in
// the parent when it forked: run_ranks in the tests, multiprocessing, DataLoader workers)
// would join threads that do not exist in it (pthread_join waits forever, or fails with EINVAL,
// which std::thread turns into std::terminate: "terminate called after throwing an instance of
// 'std::system_error' what(): Invalid argument", seen in a forked test rank on the GPU
// machine), and destroy condition variables whose waiters were those threads
// (pthread_cond_destroy waits forever for them to leave: a forked test rank hung in it here).
//
//  * OwnedThread: a std::thread that joins only in the process that started it.
//  * make_process_local<T>(...): a shared_ptr whose object is destroyed only in the process
//    that made it; a forked child that drops the last reference leaks it instead (its
//    memory, not its threads: they are the parent's). For objects whose threads wait on
//    their condition variables (Engine through NativeComm, CollWorker, ShmColl's ForkJoin).
//
// Threading: OwnedThread as std::thread (one owner calls join / assigns).
#pragma once

#include <unistd.h>

#include <memory>
#include <thread>
#include <utility>

namespace linkwise {

class OwnedThread {
 public:
  OwnedThread() = default;
  template <class F>
  explicit OwnedThread(F&& f) : thread_(std::forward<F>(f)), pid_(getpid()) {}
  OwnedThread(OwnedThread&&) = default;
  OwnedThread& operator=(OwnedThread&& other) {  // like std::thread: only onto an empty one
    thread_ = std::move(other.thread_);
    pid_ = other.pid_;
    return *this;
  }
  ~OwnedThread() { join(); }

  bool joinable() const { return thread_.joinable(); }
  // Waits for the thread in the process that started it. In a forked child the handle is
  // moved into a std::thread that is never destroyed (a few bytes, once per inherited thread):
  // neither join nor detach is safe there, and a joinable std::thread must not be destroyed.
  void join() {
    if (!thread_.joinable()) return;
    if (getpid() == pid_) {
      thread_.join();
    } else {
      new std::thread(std::move(thread_));  // NOLINT: deliberately never freed (see above)
    }
  }

 private:
  std::thread thread_;
  pid_t pid_ = 0;
};

template <class T, class... Args>
std::shared_ptr<T> make_process_local(Args&&... args) {
  const pid_t maker = getpid();
  return std::shared_ptr<T>(new T(std::forward<Args>(args)...), [maker](T* p) {
    if (getpid() == maker) delete p;  // else: a forked child's copy, left as it is (see above)
  });
}

}  // namespace linkwise
