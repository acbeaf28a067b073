// linkwise._native._RegCacheModel: the GPU plane's IPC mapping cache (csrc/cuda/reg_cache.h)
// with made-up mappings and completion tokens, so that its eviction rules are tested in every
// build, with or without CUDA (tests/test_reg_cache.py). Not used by linkwise itself.
//
// open() hands out fake addresses and records (peer, base) per address; close() records the
// address; a token is a number, pending until set_pending(token, False) (or never pending).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "cuda/reg_cache.h"

namespace nb = nanobind;

namespace linkwise {
namespace {

using linkwise::cuda::RegCache;

class RegCacheModel {
 public:
  RegCacheModel(size_t max_entries, uint64_t max_bytes) {
    cache_.max_entries = max_entries;
    cache_.max_bytes = max_bytes;
    RegCache::Hooks h;
    h.open = [this](const std::string& handle, int peer) -> void* {
      if (handle == "fail") throw std::runtime_error("open refused");
      next_ += 0x100000;
      opened_[next_] = handle;
      return reinterpret_cast<void*>(next_);
    };
    h.close = [this](void* p) {
      closed_.push_back(opened_.at(reinterpret_cast<uintptr_t>(p)));
    };
    h.done = [this](const RegCache::Token& t) {
      return pending_.count(*static_cast<const int*>(t.get())) == 0;
    };
    cache_.set_hooks(std::move(h));
  }
  uintptr_t map(int slot, int peer, uint64_t base, uint64_t bytes, const std::string& handle) {
    void* p = cache_.map(slot, peer, base, bytes, handle);
    cache_.trim();
    return reinterpret_cast<uintptr_t>(p);
  }
  // token < 0: the empty token (never completes).
  void note_use(uintptr_t stream, int token) {
    cache_.note_use(stream, token < 0 ? RegCache::Token() : RegCache::Token(new int(token), [](void* p) {
      delete static_cast<int*>(p);
    }));
  }
  void set_pending(int token, bool pending) {
    if (pending) pending_.insert(token);
    else pending_.erase(token);
  }
  RegCache cache_;
  std::map<uintptr_t, std::string> opened_;
  std::vector<std::string> closed_;  // the handles of the mappings closed, in order
  std::set<int> pending_;
  uintptr_t next_ = 0;
};

}  // namespace

void bind_reg_cache(nb::module_& m) {
  nb::class_<RegCacheModel>(m, "_RegCacheModel")
      .def(nb::init<size_t, uint64_t>(), nb::arg("max_entries"), nb::arg("max_bytes"))
      .def("map", &RegCacheModel::map, nb::arg("slot"), nb::arg("peer"), nb::arg("base"),
           nb::arg("bytes"), nb::arg("handle"),
           "slot's buffer of peer is in [base, base + bytes) exported as handle: its address "
           "(then trim(), as the engine's reg_map does)")
      .def("unset", [](RegCacheModel& c, int slot, int peer) { c.cache_.unset(slot, peer); })
      .def("is_set", [](RegCacheModel& c, int slot, int peer) { return c.cache_.is_set(slot, peer); })
      .def("note_use", &RegCacheModel::note_use, nb::arg("stream"), nb::arg("token"))
      .def("set_pending", &RegCacheModel::set_pending)
      .def("trim", [](RegCacheModel& c) { c.cache_.trim(); })
      .def("close_all", [](RegCacheModel& c) { c.cache_.close_all(); })
      .def_prop_ro("entries", [](RegCacheModel& c) { return c.cache_.entries(); })
      .def_prop_ro("bytes", [](RegCacheModel& c) { return c.cache_.bytes(); })
      .def_prop_ro("retired", [](RegCacheModel& c) { return c.cache_.retired(); })
      .def_prop_ro("closed", [](RegCacheModel& c) { return c.closed_; });
}

}  // namespace linkwise
