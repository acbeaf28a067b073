// DroppedRequests: the arrays of requests that Python dropped while another thread may still
// read or write them, held until that work is done. One holder per owner:
//   NativeComm's, of point-to-point requests dropped while their bytes moved (the engine, its
//     progress thread or a peer still copies: DroppedTransfer, native_comm.h);
//   CollWorker's, of async collectives dropped while their job was pending (its worker thread
//     still runs it: OrphanedJob, bind_coll.cc).
// Before these, such arrays were kept for good: every fire-and-forget call leaked them.
//
// Entry, one dropped request, is movable and gives
//   bool done() const     its work is over: nothing reads or writes its arrays any more (an
//                         acquire read of a flag that another thread sets);
//   void let_go()         releases its buffers (PyBuffer_Release: the GIL is held); its Python
//                         objects go when the entry is destroyed, right after (GIL held too);
//   void keep_for_good()  forgets its buffers and Python references without releasing them,
//                         so it needs no GIL and nothing it points to is ever freed.
//
// Threading: keep() and reap() run under the GIL only, from the owner's Python-facing calls;
// no other thread sees the holder (they see the entries' work, through done() only).
// Destruction: with the GIL held, the entries whose work is done are let go; the rest are kept
// for good (something may still copy into or out of them, and the GIL is not there to release
// them later). Without the GIL (a C++ owner whose last reference went on another thread), all
// of them are kept for good: releasing a buffer or a Python reference then would be unsafe.
#pragma once

#include <Python.h>

#include <utility>
#include <vector>

namespace linkwise {

template <class Entry>
class DroppedRequests {
 public:
  DroppedRequests() = default;
  DroppedRequests(const DroppedRequests&) = delete;
  DroppedRequests& operator=(const DroppedRequests&) = delete;
  ~DroppedRequests() {
    if (PyGILState_Check()) reap();
    for (Entry& e : list_) e.keep_for_good();
  }

  // Holds a request dropped with its work unfinished (GIL held).
  void keep(Entry e) { list_.push_back(std::move(e)); }

  // Lets go of the entries whose work is done (GIL held); every_one_done: of all of them, for
  // a caller that knows no work is left (CollWorker once its thread is joined).
  void reap(bool every_one_done = false) {
    if (list_.empty()) return;
    std::vector<Entry> unfinished;
    for (Entry& e : list_) {
      if (every_one_done || e.done()) e.let_go();
      else unfinished.push_back(std::move(e));
    }
    list_.swap(unfinished);  // the let-go entries' objects are dropped with `unfinished` (GIL held)
  }

 private:
  std::vector<Entry> list_;
};

}  // namespace linkwise
