#include "transport/shm/shm_transport.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/copy.h"
#include "core/process.h"
#include "core/status.h"
#include "core/wait.h"
#include "transport/shm/cma.h"

namespace linkwise {

namespace {
constexpr uint64_t kMagic = 0x6c696e6b77697365ull;  // "linkwise"
constexpr size_t kLine = 64;
// Pulled messages this large are copied by both sides, in pieces of a quarter of the message,
// 128-512 KiB. On the 2-core VM (one-way, 16-message windows, medians of 60) this moved 256 KiB
// at 9-10 GB/s and 512 KiB at 11-12 against 6.1-6.3 and 7.2-7.3 copied by the receiver
// alone, and 4 MiB at 16-19 against 13-15 in fixed 512 KiB pieces; 64 KiB pieces were slower
// (a system call and a page pinning each). docs/benchmarks.md, nineteenth session.
constexpr size_t kCoopMin = 256 << 10;
constexpr size_t kCoopPieceMin = 128 << 10;
constexpr size_t kCoopPieceMax = 512 << 10;
}  // namespace

struct InboxHeader {
  uint64_t magic;
  int32_t owner_rank;
  int32_t nranks;
  int64_t owner_pid;
  uint64_t ring_bytes;
  uint64_t owner_base;  // where the owner mapped this inbox, to probe process_vm_readv
  alignas(kLine) std::atomic<uint32_t> doorbell;
  alignas(kLine) std::atomic<uint32_t> sleepers;
  // can_pull_from[s] != 0: the owner may read rank s's memory, so s may send large messages
  // to the owner by address. Written by the owner during connect, before the setup barrier.
  alignas(kLine) std::atomic<uint8_t> can_pull_from[1];  // really [nranks]
};

// Cooperative copy of one large pulled message: the receiver publishes where the bytes go,
// then receiver and sender both take pieces (fetch_add on `next`) and count finished ones in
// `done`; the receiver acknowledges the message once done == pieces. The sender helps only
// while it waits for that ack, so an idle sender costs the receiver nothing.
// Ordering: dst/src/bytes/pieces/next/done are written before `seq` (release); a helper reads
// `seq` (acquire) and helps only when it names its own message.
struct CoopSlot {
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> next;
  std::atomic<uint32_t> done;
  uint32_t pieces;
  uint64_t piece;  // bytes of each piece but the last
  uint64_t dst;    // in the receiver's address space
  uint64_t src;    // in the sender's address space
  uint64_t bytes;
};

struct RingControl {
  alignas(kLine) std::atomic<uint64_t> tail;   // bytes ever written (sender)
  alignas(kLine) std::atomic<uint64_t> head;   // bytes ever read (receiver)
  // ack_slots[seq % kMaxPullsInFlight] = seq once the receiver has pulled message seq.
  alignas(kLine) std::atomic<uint32_t> ack_slots[PeerLink::kMaxPullsInFlight];
  alignas(kLine) CoopSlot coop[PeerLink::kMaxPullsInFlight];
  // withdrawn_slots[seq % kMaxPullsInFlight] = seq once the sender has withdrawn message seq
  // (PeerLink::withdraw), the blame + 1 in withdrawn_blame before it; the receiver reads them
  // after each pull.
  alignas(kLine) std::atomic<uint32_t> withdrawn_slots[PeerLink::kMaxPullsInFlight];
  std::atomic<int32_t> withdrawn_blame[PeerLink::kMaxPullsInFlight];
  // Set once by the writer (close_write): nothing more will come; the reader's link reports
  // the writer gone once it has read everything before it (tail is published first).
  alignas(kLine) std::atomic<uint32_t> writer_closed;
};

namespace {

size_t header_bytes(int nranks) {
  size_t h = sizeof(InboxHeader) + static_cast<size_t>(nranks);
  return (h + kLine - 1) / kLine * kLine;
}

size_t round_pow2(size_t v) {
  size_t p = 4096;
  while (p < v) p <<= 1;
  return p;
}

InboxView view_of(void* base, int nranks, size_t ring_bytes) {
  InboxView v;
  v.header = static_cast<InboxHeader*>(base);
  v.rings = reinterpret_cast<RingControl*>(static_cast<char*>(base) + header_bytes(nranks));
  v.data = reinterpret_cast<char*>(v.rings + nranks);
  v.ring_bytes = ring_bytes;
  return v;
}

void ring_doorbell(InboxHeader* h) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_relaxed) > 0) {
    h->doorbell.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&h->doorbell);
  }
}

// Reports whether a process has exited, without being fooled by a zombie: a pidfd polls
// readable once its process has terminated. Falls back to process_gone_without_pidfd (a
// zombie counts as gone there too) where pidfd_open is missing or refused.
class ProcessWatch {
 public:
  explicit ProcessWatch(int64_t pid) : pid_(pid) {
#ifdef SYS_pidfd_open
    fd_ = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
#endif
  }
  ~ProcessWatch() {
    if (fd_ >= 0) close(fd_);
  }
  bool exited() {
    if (fd_ >= 0) {
      struct pollfd p = {fd_, POLLIN, 0};
      return poll(&p, 1, 0) > 0;
    }
    return process_gone_without_pidfd(static_cast<pid_t>(pid_));
  }

 private:
  int64_t pid_;
  int fd_ = -1;
};

class ShmLink : public PeerLink {
 public:
  ShmLink(InboxView self, InboxView peer, int rank, int peer_rank, int64_t peer_pid)
      : self_(self), peer_(peer), rank_(rank), peer_rank_(peer_rank), peer_pid_(peer_pid),
        watch_(peer_pid) {
    out_ = &peer_.rings[rank_];
    in_ = &self_.rings[peer_rank_];
    out_data_ = peer_.ring_data(rank_);
    in_data_ = self_.ring_data(peer_rank_);
    out_tail_ = out_->tail.load(std::memory_order_relaxed);
    in_head_ = in_->head.load(std::memory_order_relaxed);
  }

  size_t write_some(const void* data, size_t n) override {
    const size_t cap = peer_.ring_bytes;
    uint64_t head = out_->head.load(std::memory_order_acquire);
    size_t space = cap - static_cast<size_t>(out_tail_ - head);
    size_t take = n < space ? n : space;
    if (take == 0) return 0;
    size_t pos = static_cast<size_t>(out_tail_ & (cap - 1));
    size_t first = take < cap - pos ? take : cap - pos;
    copy_bytes(out_data_ + pos, data, first);
    if (take > first) copy_bytes(out_data_, static_cast<const char*>(data) + first, take - first);
    out_tail_ += take;
    return take;
  }

  void flush() override {
    if (out_tail_ == published_tail_) return;
    out_->tail.store(out_tail_, std::memory_order_release);
    published_tail_ = out_tail_;
    ring_doorbell(peer_.header);
  }

  size_t read_some(void* dst, size_t n) override {
    const size_t cap = self_.ring_bytes;
    uint64_t tail = in_->tail.load(std::memory_order_acquire);
    size_t avail = static_cast<size_t>(tail - in_head_);
    size_t take = n < avail ? n : avail;
    if (take == 0) return 0;
    size_t pos = static_cast<size_t>(in_head_ & (cap - 1));
    size_t first = take < cap - pos ? take : cap - pos;
    copy_bytes(dst, in_data_ + pos, first);
    if (take > first) copy_bytes(static_cast<char*>(dst) + first, in_data_, take - first);
    in_head_ += take;
    in_->head.store(in_head_, std::memory_order_release);
    ring_doorbell(peer_.header);  // the writer may be asleep waiting for space
    return take;
  }

  bool alive() override {
    return !watch_.exited() && in_->writer_closed.load(std::memory_order_acquire) == 0;
  }

  void close_write() override {
    flush();
    out_->writer_closed.store(1, std::memory_order_release);
    ring_doorbell(peer_.header);
  }

  std::string describe() const override {
    return "shared memory to rank " + std::to_string(peer_rank_) + " (pid " + std::to_string(peer_pid_) + ")";
  }

  bool can_pull() const override {
    return peer_.header->can_pull_from[rank_].load(std::memory_order_relaxed) != 0;
  }

  void pull(void* dst, uint64_t remote_addr, size_t n, uint32_t seq) override {
    copy_pulled(dst, remote_addr, n, seq);
    // Ordering: the copy's reads of the sender's buffer come before this load (seq_cst fence);
    // the sender stores the withdrawal (seq_cst) before its user may write the buffer again.
    // So either the load sees the withdrawal, or the copy finished before the buffer changed.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    const uint32_t slot = seq % kMaxPullsInFlight;
    if (in_->withdrawn_slots[slot].load(std::memory_order_acquire) != seq) return;
    const int blame = in_->withdrawn_blame[slot].load(std::memory_order_relaxed) - 1;
    throw WithdrawnError("rank " + std::to_string(peer_rank_) + " withdrew a message of " + std::to_string(n) +
                             " bytes before this rank had copied it (its communicator aborted" +
                             (blame >= 0 ? " because rank " + std::to_string(blame) + " failed" : std::string()) +
                             "); the partial copy was discarded",
                         peer_rank_, blame);
  }

  void withdraw(uint32_t seq, int blame) override {
    const uint32_t slot = seq % kMaxPullsInFlight;
    out_->withdrawn_blame[slot].store(blame + 1, std::memory_order_relaxed);  // published by the next store
    out_->withdrawn_slots[slot].store(seq, std::memory_order_seq_cst);
  }

  bool help_pull(uint32_t seq, const void* src, size_t n) override {
    if (n < kCoopMin) return true;
    CoopSlot& c = out_->coop[seq % kMaxPullsInFlight];
    if (c.seq.load(std::memory_order_acquire) != seq) return false;  // not asked (yet)
    take_pieces(c, /*as_sender=*/true);
    return true;
  }

  void post_ack(uint32_t seq) override {
    in_->ack_slots[seq % kMaxPullsInFlight].store(seq, std::memory_order_release);
    ring_doorbell(peer_.header);
  }

  bool acked(uint32_t seq) override {
    return out_->ack_slots[seq % kMaxPullsInFlight].load(std::memory_order_acquire) == seq;
  }

 private:
  // One copy of message seq out of the sender's memory, with the sender's help when it is large
  // and the sender may write into us (it probed our memory at connect).
  void copy_pulled(void* dst, uint64_t remote_addr, size_t n, uint32_t seq) {
    if (n < kCoopMin || !peer_.header->can_pull_from[rank_].load(std::memory_order_relaxed)) {
      copy_from_peer(static_cast<char*>(dst), remote_addr, n);
      return;
    }
    CoopSlot& c = in_->coop[seq % kMaxPullsInFlight];
    c.piece = std::clamp(n / 4, kCoopPieceMin, kCoopPieceMax);
    c.pieces = static_cast<uint32_t>((n + c.piece - 1) / c.piece);
    c.dst = reinterpret_cast<uint64_t>(dst);
    c.src = remote_addr;
    c.bytes = n;
    c.next.store(0, std::memory_order_relaxed);
    c.done.store(0, std::memory_order_relaxed);
    c.seq.store(seq, std::memory_order_release);
    ring_doorbell(peer_.header);  // a sender asleep waiting for this ack can come and help
    take_pieces(c, /*as_sender=*/false);
    // The sender is finishing a piece it took: at most one piece of copying, unless it was
    // descheduled, so spin a little and then yield the core to it.
    for (unsigned spins = 0; c.done.load(std::memory_order_acquire) < c.pieces; ++spins) {
      if (spins < 4096) {
        cpu_relax();
        continue;
      }
      usleep(20);
      if ((spins & 0xff) == 0 && watch_.exited())
        throw Error(ErrorKind::Peer, "rank " + std::to_string(peer_rank_) + " died during a copy", peer_rank_);
    }
  }

  // Takes pieces of a cooperative copy until none is left. The receiver reads them from the
  // sender; the sender writes them into the receiver (both are one copy).
  void take_pieces(CoopSlot& c, bool as_sender) {
    for (;;) {
      const uint32_t i = c.next.fetch_add(1, std::memory_order_relaxed);
      if (i >= c.pieces) return;
      const size_t off = static_cast<size_t>(i) * c.piece;
      const size_t len = std::min<size_t>(c.piece, c.bytes - off);
      if (as_sender)
        copy_to_peer(c.dst + off, reinterpret_cast<const char*>(c.src) + off, len);
      else
        copy_from_peer(reinterpret_cast<char*>(c.dst) + off, c.src + off, len);
      c.done.fetch_add(1, std::memory_order_release);
    }
  }

  void copy_from_peer(char* out, uint64_t remote_addr, size_t n) { cma_read(peer_pid_, peer_rank_, out, remote_addr, n); }
  void copy_to_peer(uint64_t remote_addr, const char* in, size_t n) { cma_write(peer_pid_, peer_rank_, remote_addr, in, n); }

  InboxView self_, peer_;
  int rank_, peer_rank_;
  int64_t peer_pid_;
  ProcessWatch watch_;
  RingControl* out_;
  RingControl* in_;
  char* out_data_;
  char* in_data_;
  uint64_t out_tail_ = 0;
  uint64_t published_tail_ = 0;
  uint64_t in_head_ = 0;
};

}  // namespace

ShmTransport::ShmTransport(const std::string& name, int rank, int nranks, size_t ring_bytes)
    : rank_(rank), nranks_(nranks) {
  cma_allow_peers();  // peers read our memory for single-copy messages
  ring_bytes = round_pow2(ring_bytes);
  size_t total = header_bytes(nranks) + sizeof(RingControl) * nranks + ring_bytes * nranks;
  own_ = ShmSegment::create_private(name, total);  // zero-filled; no name in /dev/shm
  own_view_ = view_of(own_.data(), nranks, ring_bytes);
  InboxHeader* h = own_view_.header;
  h->owner_rank = rank;
  h->nranks = nranks;
  h->owner_pid = getpid();
  h->ring_bytes = ring_bytes;
  h->owner_base = reinterpret_cast<uint64_t>(own_.data());
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
}

ShmTransport::~ShmTransport() = default;

std::unique_ptr<PeerLink> ShmTransport::connect(int peer, const std::string& peer_name, int64_t peer_pid) {
  ShmSegment seg = ShmSegment::open(peer_name);
  auto* h = static_cast<InboxHeader*>(seg.data());
  if (h->magic != kMagic || h->nranks != nranks_ || h->owner_rank != peer)
    throw Error(ErrorKind::Internal, "shared memory segment " + peer_name + " is not rank " +
                                         std::to_string(peer) + "'s inbox of this job");
  InboxView pv = view_of(seg.data(), nranks_, h->ring_bytes);
  // Single-copy needs permission to read the peer's memory (ptrace rules, containers): probe
  // it by reading the magic number at the address where the peer mapped its own inbox.
  bool can_pull = cma_probe(peer_pid, reinterpret_cast<const void*>(h->owner_base), kMagic);
  own_view_.header->can_pull_from[peer].store(can_pull ? 1 : 0, std::memory_order_relaxed);
  peers_.push_back(std::move(seg));
  return std::make_unique<ShmLink>(own_view_, pv, rank_, peer, peer_pid);
}

uint32_t ShmTransport::begin_sleep() {
  uint32_t token = own_view_.header->doorbell.load(std::memory_order_seq_cst);
  own_view_.header->sleepers.fetch_add(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return token;
}

void ShmTransport::sleep(uint32_t token, int64_t timeout_us) {
  futex_wait(&own_view_.header->doorbell, token, timeout_us);
}

void ShmTransport::end_sleep() { own_view_.header->sleepers.fetch_sub(1, std::memory_order_seq_cst); }

void ShmTransport::wake() {
  own_view_.header->doorbell.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&own_view_.header->doorbell);
}

}  // namespace linkwise
