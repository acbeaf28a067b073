// Work-claiming push chain: the registered broadcast of bcast_chain.cu (root -> root+1 -> ...
// -> root-1, every rank but the last storing into its successor's x with SM stores), but the
// work is split into items that blocks claim dynamically instead of fixed per-block slices
// (LINKWISE_GPU_BCAST_ALGO=dchain). The fixed split left the kernel waiting for its slowest
// block: NVLink bandwidth is not shared fairly between SMs, and the per-block timestamps of
// the push chain (bench/gpu_tune.py --pchain-trace) showed blocks ending 10-30% apart.
//
// Items: x is cut into W = ceil(nbytes / item) items of `item` bytes (a multiple of 4096, at
// least nbytes / kDchainItems; the last one short). Every rank claims items in increasing
// order, so item w arrives at a rank in roughly the order its blocks ask for it.
//
// Ordering contract, per call e (EngineImpl::dchain_calls, the same on every rank since all
// ranks issue the same calls in the same order):
//  (1) a non-root's kernel starts (its stream reached the call, so its x is free) and block 0
//      posts sig[kSigChainDone][us] += 1 on its predecessor (red.release.sys) -- the same
//      hand-shake as the push chain, sharing its host totals (EngineImpl::seen);
//  (2) a rank with a successor: lane 0 of every block waits for that post (ld.acquire.sys)
//      before the block's first store into the successor's x;
//  (3) a rank with a successor: each block's control lane claims the next item w
//      (atomicAdd on our Control.dchain_claim; the host passes the counter's value at the call's
//      start, and every block ends with exactly one failing claim, so the next call's base is
//      base + W + blocks), waits (non-root) until our item_flag[w] >= e (acquire), and hands w
//      to the block's copy warps (shared memory, named barrier 1); they copy item w from our x
//      to the successor's x and arrive on barrier 2; the control warp's bar.sync(2) orders
//      their stores before lane 0's system fence (cumulative) and its st.release.sys of e into
//      the successor's item_flag[w]. As in the push chain, the control lane claims and awaits
//      item k+1 while the copy warps copy item k, and releases them before its fence;
//  (4) the last rank's threads wait until item_flag[w] >= e for every w: when its kernel ends,
//      every byte of x has arrived. Nobody reads another rank's x, and every store into our x
//      is acquired before our kernel ends, so no exit rendezvous is needed.
// item_flag[w] is written only by the (per-call) predecessor, and only after (1) of this call
// on our side, so a flag can never show a later call's value while we wait for this one's.
// Waits are wait_ge (bounded, abort polling): a wait that gives up lets the kernel go on
// without the data (claims continue, so the counter stays consistent) and the host raises
// (PeerError / TimeoutError) at its next call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/status.h"
#include "cuda/chain_util.cuh"
#include "cuda/engine_impl.h"
#include "cuda/gpu_engine.h"
#include "cuda/kernel_util.cuh"
#include "cuda/launch.h"

namespace linkwise::cuda {
namespace {

struct DchainArgs {
  const char* src = nullptr;  // our x (the root's x when it broadcasts out of place)
  char* local = nullptr;      // the root's out when it broadcasts out of place, else nullptr
  char* dst = nullptr;        // successor's x as mapped here (nullptr on the last rank)
  size_t nbytes = 0, item = 0;
  uint64_t items = 0;
  uint64_t call = 0;        // e: this call's number (item_flag value meaning "arrived")
  uint64_t claim_base = 0;  // our Control.dchain_claim at the call's start
  uint64_t ready_want = 0;  // sig[kSigChainDone][succ] total that means "successor's x is free"
  int pred = 0, succ = 0;
  bool root = false;
};

template <int kU, int kTh>
__global__ void __launch_bounds__(kTh) bcast_dchain_kernel(DevComm c, DchainArgs a) {
  Control* me = c.ctrl(c.rank);
  if (!a.root && blockIdx.x == 0 && threadIdx.x == 0)  // (1) our x is free
    red_release_sys_add(&c.ctrl(a.pred)->sig[kSigChainDone][c.rank], 1);
  if (a.dst == nullptr) {  // (4) last rank
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t w = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < a.items; w += stride)
      wait_ge(c, &me->item_flag[w], a.call);
    return;
  }
  __shared__ uint64_t s_item[2];
  if (threadIdx.x >= 32) {  // copy warps
    const int t = threadIdx.x - 32, nt = blockDim.x - 32;
    for (uint64_t k = 0;; ++k) {
      bar_sync(1);  // go k
      const uint64_t w = s_item[k & 1];
      if (w >= a.items) return;
      const size_t off = w * a.item, n = a.nbytes - off < a.item ? a.nbytes - off : a.item;
      slice_copy<kU>(a.dst + off, a.src + off, n, t, nt, a.local ? a.local + off : nullptr);
      bar_arrive(2);  // our stores of item w are issued
    }
  }
  // Control warp: lane 0 claims, waits and posts; the whole warp takes part in the barriers.
  uint64_t* theirs = c.ctrl(a.succ)->item_flag;
  auto claim = [&]() -> uint64_t {  // lane 0: the next item (may be >= items), awaited (non-root)
    const uint64_t w = atomicAdd(reinterpret_cast<unsigned long long*>(&me->dchain_claim), 1ull) - a.claim_base;
    if (!a.root && w < a.items) wait_ge(c, &me->item_flag[w], a.call);
    return w;
  };
  uint64_t cur = 0;
  if (threadIdx.x == 0) {
    wait_ge(c, &me->sig[kSigChainDone][a.succ], a.ready_want);  // (2)
    cur = claim();
    s_item[0] = cur;
  }
  cur = __shfl_sync(0xffffffffu, cur, 0);
  bar_sync(1);  // go 0
  for (uint64_t k = 0; cur < a.items; ++k) {
    uint64_t next = 0;
    if (threadIdx.x == 0) {
      next = claim();  // while the copy warps copy item cur
      s_item[(k + 1) & 1] = next;
    }
    next = __shfl_sync(0xffffffffu, next, 0);
    bar_sync(2);  // every copy warp issued its stores of item cur
    bar_sync(1);  // go k + 1 (item next, or the end)
    if (threadIdx.x == 0) {
      __threadfence_system();  // cumulative: the copy warps' stores of item cur (ordered by bar 2)
      st_release_sys(&theirs[cur], a.call);
    }
    cur = next;
  }
}

}  // namespace

void GpuEngine::broadcast_dchain(char* xp, size_t nbytes, int root, uintptr_t stream, const char* root_src) {
  EngineImpl& im = *impl_;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int pos = (rank_ - root + nranks_) % nranks_;
  const int pred = (rank_ - 1 + nranks_) % nranks_, succ = (rank_ + 1) % nranks_;
  const bool last = pos == nranks_ - 1;
  if (!last && !im.reg[0][succ]) throw Error(ErrorKind::Invalid, "broadcast_reg: successor's buffer not mapped");
  // Tuning knobs (read per call; every rank must see the same values): blocks, item bytes
  // (rounded up to 4096 and to at least nbytes / kDchainItems), threads per block (512/1024).
  const char* e = std::getenv("LINKWISE_GPU_DCHAIN_BLOCKS");
  int blocks = e && std::atoi(e) > 0 ? std::min(std::atoi(e), 1024) : 32;
  e = std::getenv("LINKWISE_GPU_DCHAIN_ITEM");
  size_t item = e && std::atoll(e) > 0 ? static_cast<size_t>(std::atoll(e)) : (128u << 10);
  item = std::min<size_t>(item, size_t(1) << 30);
  item = std::max(item, (nbytes + kDchainItems - 1) / kDchainItems);
  item = (item + 4095) / 4096 * 4096;
  e = std::getenv("LINKWISE_GPU_DCHAIN_THREADS");
  const bool t512 = e && std::atoi(e) == 512;
  DchainArgs a;
  a.src = xp, a.dst = last ? nullptr : im.reg[0][succ], a.nbytes = nbytes, a.item = item;
  if (pos == 0 && root_src != nullptr) a.src = root_src, a.local = xp;  // out of place: x -> succ and out
  a.items = (nbytes + item - 1) / item;
  a.call = ++im.dchain_calls;
  a.claim_base = im.dchain_claimed;
  a.pred = pred, a.succ = succ, a.root = pos == 0;
  if (!last) {
    a.ready_want = ++im.seen[kSigChainDone][succ];
    im.dchain_claimed += a.items + blocks;  // W successful claims and one failing claim per block
  }
  check_launch("broadcast");
  if (t512) bcast_dchain_kernel<4, kThreads><<<blocks, kThreads, 0, s>>>(im.dev, a);
  else bcast_dchain_kernel<4, 1024><<<blocks, 1024, 0, s>>>(im.dev, a);
  check_launch("broadcast");
}

}  // namespace linkwise::cuda
