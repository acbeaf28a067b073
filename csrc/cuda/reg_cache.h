// RegCache: the registered-buffer path's cache of peers' allocations mapped through CUDA IPC
// (reg_engine.cu). Bookkeeping only, with no CUDA types, so that the CPU build tests it too
// (bindings/bind_reg_cache.cc, tests/test_reg_cache.py); the engine supplies the CUDA calls
// as Hooks.
//
// Why it is bounded. A mapping opened with cudaIpcOpenMemHandle keeps the peer's allocation
// alive: memory the peer frees stays allocated on its GPU until every process that mapped it
// closes its mapping. (The exporting side keeps nothing: reg_describe asks
// cudaIpcGetMemHandle afresh each time and holds no reference.) So an entry is closed
//  * as soon as it is safe (below) once its peer describes an allocation that overlaps it
//    with another base or another handle: two live allocations never overlap, so the old
//    one has been freed (the entry is "retired");
//  * least recently used first while more than max_entries entries, or more than max_bytes
//    bytes of peers' allocations, are mapped.
// Safety. An entry is never closed while work enqueued on any stream may still read or write
// through it. After each operation that used the slots' buffers the engine hands note_use a
// completion token (a CUDA event recorded on the operation's stream after all its work; the
// side stream of a two-stream pipeline is joined back into that stream first), and every
// entry a slot references keeps the latest token of each stream it was used on (a later token
// on one stream completes after the earlier ones there: stream order). An entry is closed
// only once every token it keeps has completed (Hooks::done). The host never waits for that:
// an entry whose work is still pending stays (retired, or over the bound) and is looked at
// again by the next trim(). Waiting could deadlock: the pending work may wait for a peer that
// is itself waiting for this host in a host exchange. Entries that a slot references (the
// buffers of the operation being set up; slot 2, the prs scratch, is mapped once and stays
// referenced) are never closed by the bound.
//
// Threading: one thread at a time (GpuEngine's contract; the deferred receives' cache is
// used under EngineImpl::p2p_mu).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace linkwise::cuda {

class RegCache {
 public:
  // Completion token of the work enqueued up to a point of a stream (a CUDA event). An empty
  // token never completes: its entries stay mapped until close_all (the engine hands one
  // over when it could not record an event).
  using Token = std::shared_ptr<void>;
  struct Hooks {
    std::function<void*(const std::string& handle, int peer)> open;  // maps, or throws
    std::function<void(void*)> close;
    std::function<bool(const Token&)> done;  // has the work before the token completed?
  };
  static constexpr int kSlots = 3;

  RegCache() = default;
  RegCache(const RegCache&) = delete;
  RegCache& operator=(const RegCache&) = delete;

  void set_hooks(Hooks hooks) { hooks_ = std::move(hooks); }
  size_t max_entries = 128;
  uint64_t max_bytes = uint64_t(4) << 30;

  // Slot `slot` of `peer` now references the peer's allocation [base, base + bytes), exported
  // as `handle`: its mapping, cached or opened now (retiring the peer's entries it overlaps).
  void* map(int slot, int peer, uint64_t base, uint64_t bytes, const std::string& handle) {
    unset(slot, peer);
    const Key key{peer, base};
    auto it = live_.find(key);
    if (it == live_.end() || it->second.handle != handle) {
      retire_overlapping(peer, base, bytes);
      Entry e;
      e.peer = peer, e.base = base, e.bytes = bytes, e.handle = handle;
      e.mapped = hooks_.open(handle, peer);
      it = live_.emplace(key, std::move(e)).first;
      bytes_ += bytes;
    }
    it->second.last_use = ++tick_;
    refs_.push_back(Ref{slot, peer, key});
    return it->second.mapped;
  }

  void unset(int slot, int peer) {
    refs_.erase(std::remove_if(refs_.begin(), refs_.end(),
                               [&](const Ref& r) { return r.slot == slot && r.peer == peer; }),
                refs_.end());
  }
  // False once the entry the slot referenced was retired (the engine then forgets its pointer).
  bool is_set(int slot, int peer) const {
    return std::any_of(refs_.begin(), refs_.end(),
                       [&](const Ref& r) { return r.slot == slot && r.peer == peer; });
  }

  // The operation that used the slots' buffers was enqueued on `stream` up to `token`.
  void note_use(uintptr_t stream, const Token& token) {
    for (const Ref& r : refs_) {
      auto it = live_.find(r.key);
      if (it == live_.end()) continue;
      auto& uses = it->second.uses;
      auto same = std::find_if(uses.begin(), uses.end(),
                               [&](const Use& u) { return u.first == stream; });
      if (same != uses.end()) {
        same->second = token;
      } else {
        if (uses.size() >= 4) prune(uses);  // streams whose work is done need no token
        uses.emplace_back(stream, token);
      }
    }
  }

  // Closes the retired entries whose work is done, then the least recently used ones that are
  // done and unreferenced while over the bound. Never waits.
  void trim() {
    for (size_t i = 0; i < retired_.size();) {
      if (all_done(retired_[i])) {
        hooks_.close(retired_[i].mapped);
        retired_.erase(retired_.begin() + static_cast<long>(i));
      } else {
        ++i;
      }
    }
    if (live_.size() <= max_entries && bytes_ <= max_bytes) return;
    std::vector<std::pair<uint64_t, Key>> order;  // (last use, key), oldest first
    for (const auto& kv : live_)
      if (!referenced(kv.first)) order.emplace_back(kv.second.last_use, kv.first);
    std::sort(order.begin(), order.end());
    for (const auto& o : order) {
      if (live_.size() <= max_entries && bytes_ <= max_bytes) break;
      auto it = live_.find(o.second);
      if (!all_done(it->second)) continue;
      hooks_.close(it->second.mapped);
      bytes_ -= it->second.bytes;
      live_.erase(it);
    }
  }

  // Closes everything; the caller has waited for all work of the device first.
  void close_all() {
    for (auto& kv : live_) hooks_.close(kv.second.mapped);
    for (auto& e : retired_) hooks_.close(e.mapped);
    live_.clear();
    retired_.clear();
    refs_.clear();
    bytes_ = 0;
  }

  size_t entries() const { return live_.size(); }
  uint64_t bytes() const { return bytes_; }
  size_t retired() const { return retired_.size(); }

 private:
  using Key = std::pair<int, uint64_t>;  // (peer, base of the peer's allocation)
  using Use = std::pair<uintptr_t, Token>;  // (stream, its latest token)
  struct Entry {
    int peer = -1;
    uint64_t base = 0, bytes = 0;
    std::string handle;  // the cudaIpcMemHandle bytes it was opened from
    void* mapped = nullptr;
    uint64_t last_use = 0;
    std::vector<Use> uses;
  };
  struct Ref {
    int slot, peer;
    Key key;
  };

  bool referenced(const Key& k) const {
    return std::any_of(refs_.begin(), refs_.end(), [&](const Ref& r) { return r.key == k; });
  }
  void prune(std::vector<Use>& uses) {
    uses.erase(std::remove_if(uses.begin(), uses.end(),
                              [&](const Use& u) { return u.second && hooks_.done(u.second); }),
               uses.end());
  }
  bool all_done(Entry& e) {
    prune(e.uses);
    return e.uses.empty();
  }
  void retire_overlapping(int peer, uint64_t base, uint64_t bytes) {
    for (auto it = live_.lower_bound(Key{peer, 0}); it != live_.end() && it->first.first == peer;) {
      const Entry& e = it->second;
      if (e.base < base + bytes && base < e.base + e.bytes) {
        const Key k = it->first;
        refs_.erase(std::remove_if(refs_.begin(), refs_.end(), [&](const Ref& r) { return r.key == k; }),
                    refs_.end());
        bytes_ -= e.bytes;
        retired_.push_back(std::move(it->second));
        it = live_.erase(it);
      } else {
        ++it;
      }
    }
  }

  Hooks hooks_;
  std::map<Key, Entry> live_;
  std::vector<Entry> retired_;  // freed by their peer; closed once their work is done
  std::vector<Ref> refs_;       // what each slot references now
  uint64_t bytes_ = 0, tick_ = 0;
};

}  // namespace linkwise::cuda
