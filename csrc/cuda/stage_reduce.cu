// StageReduce (stage_reduce.h): host-staged all_reduce through shared pinned memory. Host code
// only: copy engines move the bytes, this thread reduces and publishes the flags.
#include "cuda/stage_reduce.h"


#include <atomic>
#include <cstring>

#include "core/reduce.h"
#include "core/status.h"
#include "cuda/engine_impl.h"
#include "cuda/stage_pacer.h"
#include "cuda/launch.h"

namespace linkwise::cuda {

namespace {
constexpr uint64_t kMagic = 0x6c77737264310000ull;  // "lwsrd1"
constexpr size_t kDataOffset = 4096;
constexpr int kMaxSlots = 16;

struct alignas(64) Counter {
  std::atomic<uint64_t> v;  // written by the segment's owner only (release), read (acquire)
  char pad[56];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "needs lock-free 64-bit atomics");

linkwise::DType core_dtype(int d) {
  switch (d) {
    case kF32: return linkwise::DType::F32;
    case kI32: return linkwise::DType::I32;
    case kF64: return linkwise::DType::F64;
    case kI64: return linkwise::DType::I64;
    case kF16: return linkwise::DType::F16;
    default: return linkwise::DType::BF16;
  }
}

// acc (float32) op= widen(src); first: acc = widen(src).
template <bool kBf16>
void acc16(float* acc, const uint16_t* src, size_t n, int op, bool first) {
  auto widen = [](uint16_t h) { return kBf16 ? bf16_to_float(h) : half_to_float(h); };
  if (first) {
    for (size_t i = 0; i < n; ++i) acc[i] = widen(src[i]);
    return;
  }
  switch (op) {
    case kProd: for (size_t i = 0; i < n; ++i) acc[i] *= widen(src[i]); return;
    case kMin:
      for (size_t i = 0; i < n; ++i) { float v = widen(src[i]); acc[i] = v < acc[i] ? v : acc[i]; }
      return;
    case kMax:
      for (size_t i = 0; i < n; ++i) { float v = widen(src[i]); acc[i] = acc[i] < v ? v : acc[i]; }
      return;
    default: for (size_t i = 0; i < n; ++i) acc[i] += widen(src[i]); return;  // sum, avg
  }
}
}  // namespace

struct StageReduceFlags {
  uint64_t magic, slots, slot_bytes, nranks;
  char pad[32];
  // ctr[kInReady][s]: chunk + 1 whose device->host copy into in[s] completed;
  // ctr[kRedReady][s]: chunk + 1 whose part this rank reduced into out[s];
  // ctr[kH2d][s]: chunk + 1 whose host->device copies out of every out[s] completed.
  Counter ctr[3][kMaxSlots];
};
enum : int { kInReady = 0, kRedReady = 1, kH2d = 2 };
static_assert(sizeof(StageReduceFlags) <= kDataOffset, "flags must fit before the data");

void StageReduce::fail(const char* what, cudaError_t e) const {
  throw Error(ErrorKind::Internal, "rank " + std::to_string(rank_) + ": host-staged all_reduce: " +
                                       what + " failed on device " + std::to_string(device_) +
                                       ": " + cudaGetErrorString(e));
}

StageReduce::StageReduce(int rank, int nranks, int slots, size_t slot_bytes, int device,
                         double timeout_s, const GpuEngine* engine, const std::string& label)
    : rank_(rank), nranks_(nranks), slots_(slots), device_(device),
      slot_bytes_((slot_bytes + 4095) / 4096 * 4096), timeout_s_(timeout_s), engine_(engine) {
  if (slots < 2 || slots > kMaxSlots || nranks < 1 || rank < 0 || rank >= nranks || slot_bytes == 0)
    throw Error(ErrorKind::Invalid, "StageReduce: bad geometry");
  own_ = ShmSegment::create_private(label, kDataOffset + 2 * static_cast<size_t>(slots) * slot_bytes_);
  auto* f = static_cast<StageReduceFlags*>(own_.data());  // a new memfd reads as zeros
  f->slots = slots, f->slot_bytes = slot_bytes_, f->nranks = nranks;
  std::atomic_thread_fence(std::memory_order_release);
  f->magic = kMagic;  // peers open it only after hearing its name from us (host message)
  peers_.resize(nranks);
  base_.assign(nranks, nullptr);
  base_[rank] = static_cast<char*>(own_.data());
  DeviceGuard g(device_);
  cudaError_t e = cudaHostRegister(own_.data(), own_.size(), cudaHostRegisterPortable);
  if (e != cudaSuccess) fail("cudaHostRegister of the shared staging segment", e);
  registered_.push_back(own_.data());
  if ((e = cudaStreamCreateWithFlags(&d2h_, cudaStreamNonBlocking)) != cudaSuccess ||
      (e = cudaStreamCreateWithFlags(&h2d_, cudaStreamNonBlocking)) != cudaSuccess ||
      (e = cudaEventCreateWithFlags(&entry_, cudaEventDisableTiming)) != cudaSuccess)
    fail("stream/event creation", e);
  d2h_ev_.assign(slots, nullptr);
  h2d_ev_.assign(slots, nullptr);
  for (int s = 0; s < slots; ++s)
    if ((e = cudaEventCreateWithFlags(&d2h_ev_[s], cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&h2d_ev_[s], cudaEventDisableTiming)) != cudaSuccess)
      fail("event creation", e);
}

StageReduce::~StageReduce() {
  DeviceGuard g(device_);
  if (d2h_) cudaStreamSynchronize(d2h_);
  if (h2d_) cudaStreamSynchronize(h2d_);
  for (auto ev : d2h_ev_) if (ev) cudaEventDestroy(ev);
  for (auto ev : h2d_ev_) if (ev) cudaEventDestroy(ev);
  if (entry_) cudaEventDestroy(entry_);
  if (d2h_) cudaStreamDestroy(d2h_);
  if (h2d_) cudaStreamDestroy(h2d_);
  for (void* p : registered_) cudaHostUnregister(p);
}

void StageReduce::attach(const std::vector<std::string>& names) {
  if (static_cast<int>(names.size()) != nranks_)
    throw Error(ErrorKind::Invalid, "StageReduce.attach: one name per rank");
  DeviceGuard g(device_);
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_ || base_[r]) continue;
    peers_[r] = ShmSegment::open(names[r]);
    auto* f = static_cast<const StageReduceFlags*>(peers_[r].data());
    if (peers_[r].size() < own_.size() || f->magic != kMagic || f->slots != static_cast<uint64_t>(slots_) ||
        f->slot_bytes != slot_bytes_ || f->nranks != static_cast<uint64_t>(nranks_))
      throw Error(ErrorKind::Invalid, "StageReduce: rank " + std::to_string(r) +
                                          "'s staging segment has another geometry (every rank must "
                                          "use the same LINKWISE_CHUNK_SIZE and LINKWISE_STAGED_BUFFERS)");
    cudaError_t e = cudaHostRegister(peers_[r].data(), peers_[r].size(), cudaHostRegisterPortable);
    if (e != cudaSuccess) fail("cudaHostRegister of a peer's staging segment", e);
    registered_.push_back(peers_[r].data());
    base_[r] = static_cast<char*>(peers_[r].data());
  }
}

StageReduceFlags* StageReduce::flags(int r) const { return reinterpret_cast<StageReduceFlags*>(base_[r]); }
char* StageReduce::in(int r, int s) const { return base_[r] + kDataOffset + static_cast<size_t>(s) * slot_bytes_; }
char* StageReduce::out(int r, int s) const {
  return base_[r] + kDataOffset + static_cast<size_t>(slots_ + s) * slot_bytes_;
}

// Part [lo, hi) of chunk k (len elements): every rank's in[s] in rank order -> our out[s].
void StageReduce::reduce_part(uint64_t k, size_t len, size_t lo, size_t hi, int dtype, int op) {
  (void)len;
  const int s = static_cast<int>(k % slots_);
  const size_t n = hi - lo, es = dtype_size(dtype);
  if (n == 0) return;
  char* dst = out(rank_, s) + lo * es;
  if (dtype == kF16 || dtype == kBF16) {
    if (acc_.size() < n) acc_.resize(n);
    for (int q = 0; q < nranks_; ++q) {
      auto* src = reinterpret_cast<const uint16_t*>(in(q, s) + lo * es);
      if (dtype == kBF16) acc16<true>(acc_.data(), src, n, op, q == 0);
      else acc16<false>(acc_.data(), src, n, op, q == 0);
    }
    auto* o = reinterpret_cast<uint16_t*>(dst);
    const float dv = static_cast<float>(nranks_);
    for (size_t i = 0; i < n; ++i) {
      float v = op == kAvg ? acc_[i] / dv : acc_[i];
      o[i] = dtype == kBF16 ? float_to_bf16(v) : float_to_half(v);
    }
    return;
  }
  const linkwise::DType t = core_dtype(dtype);
  const auto rop = static_cast<linkwise::RedOp>(op);  // same numbering: Sum Prod Min Max Avg
  if (nranks_ == 1) {
    std::memcpy(dst, in(0, s) + lo * es, n * es);
  } else {
    reduce3(dst, in(0, s) + lo * es, in(1, s) + lo * es, n, t, rop);
    for (int q = 2; q < nranks_; ++q) reduce_into(dst, in(q, s) + lo * es, n, t, rop);
  }
  if (op == kAvg) avg_finish(dst, n, t, nranks_);
}

void StageReduce::all_reduce(uintptr_t x, uintptr_t outp, size_t count, int dtype, int op,
                             uintptr_t stream) {
  const size_t es = dtype_size(dtype);
  if (es == 0 || op < kSum || op > kAvg) throw Error(ErrorKind::Type, "host-staged all_reduce: bad dtype or op");
  if (count == 0) return;
  for (int r = 0; r < nranks_; ++r)
    if (!base_[r]) throw Error(ErrorKind::Invalid, "StageReduce: attach() first");
  DeviceGuard g(device_);
  const char* xs = reinterpret_cast<const char*>(x);
  char* od = reinterpret_cast<char*>(outp);
  const uint64_t S = static_cast<uint64_t>(slots_), N = static_cast<uint64_t>(nranks_);
  const size_t chunk = slot_bytes_ / es;
  const uint64_t nch = (count + chunk - 1) / chunk, k0 = next_;
  auto len_of = [&](uint64_t i) { return count - i * chunk < chunk ? count - i * chunk : chunk; };
  auto part = [&](size_t len, uint64_t q) { return len * q / N; };  // part q = [part(q), part(q+1))
  auto all_ge = [&](int which, int s, uint64_t want) {
    for (int q = 0; q < nranks_; ++q)
      if (flags(q)->ctr[which][s].v.load(std::memory_order_acquire) < want) return false;
    return true;
  };
  cudaError_t e = cudaEventRecord(entry_, reinterpret_cast<cudaStream_t>(stream));
  if (e == cudaSuccess) e = cudaStreamWaitEvent(d2h_, entry_, 0);  // x is final on the GPU
  if (e == cudaSuccess) e = cudaStreamWaitEvent(h2d_, entry_, 0);  // and out free to write
  if (e != cudaSuccess) fail("stream ordering", e);
  uint64_t d2h_issued = 0, d2h_done = 0, reduced = 0, h2d_issued = 0, h2d_done = 0;
  StagePacer pacer(timeout_s_, engine_);
  while (h2d_done < nch) {
    bool progress = false;
    auto retire = [&](uint64_t& done, uint64_t issued, std::vector<cudaEvent_t>& evs,
                      int which, const char* what) {
      while (done < issued) {
        const uint64_t k = k0 + done;
        cudaError_t q = cudaEventQuery(evs[k % S]);
        if (q == cudaErrorNotReady) break;
        if (q != cudaSuccess) fail(what, q);
        flags(rank_)->ctr[which][k % S].v.store(k + 1, std::memory_order_release);
        ++done;
        progress = true;
      }
    };
    retire(d2h_done, d2h_issued, d2h_ev_, kInReady, "device->host copy");
    retire(h2d_done, h2d_issued, h2d_ev_, kH2d, "host->device copy");
    // (1) device -> host into our in[s], once every rank is done with chunk k - S.
    while (d2h_issued < nch && d2h_issued - h2d_done < S) {
      const uint64_t k = k0 + d2h_issued;
      const int s = static_cast<int>(k % S);
      if (k >= S && !all_ge(kH2d, s, k - S + 1)) break;
      const size_t len = len_of(d2h_issued);
      e = cudaMemcpyAsync(in(rank_, s), xs + d2h_issued * chunk * es, len * es, cudaMemcpyDeviceToHost, d2h_);
      if (e == cudaSuccess) e = cudaEventRecord(d2h_ev_[s], d2h_);
      if (e != cudaSuccess) fail("device->host copy", e);
      ++d2h_issued;
      progress = true;
    }
    // (2) reduce our part once every rank's in[s] holds chunk k.
    while (reduced < d2h_done) {
      const uint64_t k = k0 + reduced;
      const int s = static_cast<int>(k % S);
      if (!all_ge(kInReady, s, k + 1)) break;
      const size_t len = len_of(reduced);
      reduce_part(k, len, part(len, rank_), part(len, rank_ + 1), dtype, op);
      flags(rank_)->ctr[kRedReady][s].v.store(k + 1, std::memory_order_release);
      ++reduced;
      progress = true;
    }
    // (3) host -> device of every rank's part once all are reduced.
    while (h2d_issued < reduced) {
      const uint64_t k = k0 + h2d_issued;
      const int s = static_cast<int>(k % S);
      if (!all_ge(kRedReady, s, k + 1)) break;
      const size_t len = len_of(h2d_issued);
      char* dst = od + h2d_issued * chunk * es;
      e = cudaSuccess;
      for (int q = 0; q < nranks_ && e == cudaSuccess; ++q) {
        const size_t lo = part(len, q), hi = part(len, q + 1);
        if (hi > lo) e = cudaMemcpyAsync(dst + lo * es, out(q, s) + lo * es, (hi - lo) * es, cudaMemcpyHostToDevice, h2d_);
      }
      if (e == cudaSuccess) e = cudaEventRecord(h2d_ev_[s], h2d_);
      if (e != cudaSuccess) fail("host->device copy", e);
      ++h2d_issued;
      progress = true;
    }
    if (progress) {
      pacer.progressed();
      continue;
    }
    pacer.idle([&] {
      return "rank " + std::to_string(rank_) + ": host-staged all_reduce waited " +
             seconds_text(timeout_s_) + " for a peer (chunk " + std::to_string(h2d_done) +
             " of " + std::to_string(nch) + ")";
    });
  }
  next_ = k0 + nch;
}

}  // namespace linkwise::cuda
