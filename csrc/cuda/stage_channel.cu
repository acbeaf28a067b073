// StageChannel (stage_channel.h): host-staged transfers through pinned shared memory. Host
// code only (no kernels): the copy engines move the bytes, the host publishes flags.
#include "cuda/stage_channel.h"

#include <sys/mman.h>

#include <atomic>
#include <cstring>

#include "core/status.h"
#include "cuda/engine_impl.h"
#include "cuda/stage_pacer.h"

namespace linkwise::cuda {

namespace {
constexpr uint64_t kMagic = 0x6c77737467310000ull;  // "lwstg1"
constexpr size_t kDataOffset = 4096;
constexpr int kMaxSlots = 16;  // LINKWISE_STAGED_BUFFERS is clamped to this (staged.py)

// Flags of one slot, each on its own cache line (written by different processes).
struct alignas(64) SlotFlags {
  std::atomic<uint64_t> full;  // chunk index + 1 last published by the writer (release)
  char pad0[56];
  std::atomic<uint64_t> acks;  // readers' completed copies out of this slot, cumulative
  char pad1[56];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "needs lock-free 64-bit atomics");
}  // namespace

struct StageHeader {
  uint64_t magic;
  uint64_t slots;
  uint64_t slot_bytes;
  uint64_t readers;
  std::atomic<uint64_t> stopped;  // 0, or the error code of the side that stopped it (stop())
  char pad[24];
  SlotFlags flag[kMaxSlots];
};
static_assert(sizeof(StageHeader) <= kDataOffset, "header must fit before the data");

void StageChannel::fail(const char* what, cudaError_t e) const {
  throw Error(ErrorKind::Internal, std::string("host-staged ") + what + " failed on device " +
                                       std::to_string(device_) + ": " + cudaGetErrorString(e));
}

StageChannel::StageChannel(const std::string& name, bool create, int readers, int slots,
                           size_t slot_bytes, int device, double timeout_s,
                           const GpuEngine* engine)
    : engine_(engine), device_(device), timeout_s_(timeout_s) {
  if (create) {
    if (slots < 2 || slots > kMaxSlots || readers < 1 || slot_bytes == 0)
      throw Error(ErrorKind::Invalid, "StageChannel: bad geometry");
    slot_bytes = (slot_bytes + 4095) / 4096 * 4096;
    seg_ = ShmSegment::create_private(name, kDataOffset + static_cast<size_t>(slots) * slot_bytes);
    hdr_ = static_cast<StageHeader*>(seg_.data());  // a new memfd reads as zeros
    hdr_->slots = slots;
    hdr_->slot_bytes = slot_bytes;
    hdr_->readers = readers;
    std::atomic_thread_fence(std::memory_order_release);
    hdr_->magic = kMagic;  // readers open only after hearing the name from us (host message)
  } else {
    seg_ = ShmSegment::open(name);
    hdr_ = static_cast<StageHeader*>(seg_.data());
    if (seg_.size() < kDataOffset || hdr_->magic != kMagic)
      throw Error(ErrorKind::Invalid, "StageChannel: " + name + " is not a staging segment");
  }
  slots_ = static_cast<int>(hdr_->slots);
  slot_bytes_ = hdr_->slot_bytes;
  readers_ = static_cast<int>(hdr_->readers);
  data_ = static_cast<char*>(seg_.data()) + kDataOffset;
  DeviceGuard g(device_);
  // Pin the whole mapping (flags included) so the copy engines DMA straight into it.
  cudaError_t e = cudaHostRegister(seg_.data(), seg_.size(), cudaHostRegisterPortable);
  if (e != cudaSuccess) fail("cudaHostRegister of the shared staging segment", e);
  registered_ = true;
  events_.resize(slots_);
  for (auto& ev : events_) {
    e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess) fail("cudaEventCreate", e);
  }
}

StageChannel::~StageChannel() {
  DeviceGuard g(device_);
  for (auto ev : events_)
    if (ev) {
      cudaEventSynchronize(ev);
      cudaEventDestroy(ev);
    }
  if (registered_) cudaHostUnregister(seg_.data());
}

void StageChannel::unlink() { seg_.unlink(); }  // writer: closes the memfd; reader: no-op

void StageChannel::stop(uint64_t code) { hdr_->stopped.store(code, std::memory_order_release); }

void StageChannel::check_stopped() const {
  const uint64_t code = hdr_->stopped.load(std::memory_order_acquire);
  if (!code) return;
  if (engine_) {  // the communicator's error from now on, then raised as its check() words it
    engine_->note_stop(code);
    engine_->check();
  }
  throw Error(ErrorKind::Aborted, "host-staged transfer: the other side stopped this channel");
}

void StageChannel::write(uintptr_t src, size_t nbytes, uintptr_t stream) {
  run(true, reinterpret_cast<char*>(src), nbytes, reinterpret_cast<cudaStream_t>(stream));
}

void StageChannel::read(uintptr_t dst, size_t nbytes, uintptr_t stream) {
  run(false, reinterpret_cast<char*>(dst), nbytes, reinterpret_cast<cudaStream_t>(stream));
}

// One message on this side. issued: chunks whose copy is enqueued; done: chunks whose copy has
// completed and been published (writer: full; reader: acks). done <= issued <= done + slots.
void StageChannel::run(bool writer, char* dev, size_t nbytes, cudaStream_t s) {
  if (nbytes == 0) return;
  DeviceGuard g(device_);
  const uint64_t S = static_cast<uint64_t>(slots_);
  const uint64_t nch = (nbytes + slot_bytes_ - 1) / slot_bytes_;
  const uint64_t k0 = next_;
  uint64_t issued = 0, done = 0;
  StagePacer pacer(timeout_s_, engine_);
  check_stopped();
  while (done < nch) {
    bool progress = false;
    // Retire, in order, the copies that have completed.
    while (done < issued) {
      uint64_t k = k0 + done;
      cudaError_t q = cudaEventQuery(events_[k % S]);
      if (q == cudaErrorNotReady) break;
      if (q != cudaSuccess) fail(writer ? "device->host copy" : "host->device copy", q);
      SlotFlags& f = hdr_->flag[k % S];
      if (writer)
        f.full.store(k + 1, std::memory_order_release);  // the D2H bytes are in the slot
      else
        f.acks.fetch_add(1, std::memory_order_release);  // our H2D no longer reads the slot
      ++done;
      progress = true;
    }
    // Enqueue the next copies whose slot is ready.
    while (issued < nch && issued - done < S) {
      uint64_t k = k0 + issued;
      SlotFlags& f = hdr_->flag[k % S];
      bool ready = writer ? f.acks.load(std::memory_order_acquire) >= (k / S) * readers_
                          : f.full.load(std::memory_order_acquire) >= k + 1;
      if (!ready) break;
      size_t off = issued * slot_bytes_;
      size_t n = nbytes - off < slot_bytes_ ? nbytes - off : slot_bytes_;
      char* slot = data_ + (k % S) * slot_bytes_;
      cudaError_t e = writer ? cudaMemcpyAsync(slot, dev + off, n, cudaMemcpyDeviceToHost, s)
                             : cudaMemcpyAsync(dev + off, slot, n, cudaMemcpyHostToDevice, s);
      if (e != cudaSuccess) fail(writer ? "device->host copy" : "host->device copy", e);
      e = cudaEventRecord(events_[k % S], s);
      if (e != cudaSuccess) fail("cudaEventRecord", e);
      ++issued;
      progress = true;
    }
    if (progress) {
      pacer.progressed();
      continue;
    }
    check_stopped();
    pacer.idle([&] {
      return std::string("host-staged ") + (writer ? "send" : "receive") + " waited " +
             seconds_text(timeout_s_) + " for the peer (chunk " + std::to_string(done) +
             " of " + std::to_string(nch) + ")";
    });
  }
  next_ = k0 + nch;
}

}  // namespace linkwise::cuda
