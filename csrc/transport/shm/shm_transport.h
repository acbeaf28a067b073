// Shared-memory transport between processes of one host.
//
// Each rank owns one "inbox" segment: a header with its doorbell, then one single-producer /
// single-consumer byte ring per sending peer. Rank s writes into ring[s] of rank r's inbox;
// only r reads it. Large messages skip the ring: the sender publishes its buffer's address
// and the receiver copies it out with process_vm_readv (one copy), then counts an ack.
//
//   inbox of rank r:  [InboxHeader][RingControl x n][ring data x n]
//                                   ^ ring[s]: tail (s writes), head (r writes), acked (r writes)
//
// Memory ordering: ring bytes are published by a release store of tail and consumed after an
// acquire load of it; head likewise in the other direction. Sleeping uses the doorbell futex:
// a sleeper bumps `sleepers` and then re-checks; a writer publishes and then, if `sleepers`
// is non-zero, bumps the doorbell and wakes (both sides with seq_cst fences in between).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/shm/shm_segment.h"
#include "transport/transport.h"

namespace linkwise {

struct InboxHeader;
struct RingControl;

// One inbox, ours or a peer's, as laid out in memory.
struct InboxView {
  InboxHeader* header = nullptr;
  RingControl* rings = nullptr;
  char* data = nullptr;
  size_t ring_bytes = 0;
  char* ring_data(int sender) const { return data + static_cast<size_t>(sender) * ring_bytes; }
};

class ShmTransport : public Transport {
 public:
  // Creates this rank's inbox (a private segment labelled `name`) with a ring of ring_bytes
  // (rounded up to a power of two) for each of nranks senders.
  ShmTransport(const std::string& name, int rank, int nranks, size_t ring_bytes);
  ~ShmTransport() override;

  // Maps peer's inbox and returns the link to it. Also records whether this process may read
  // the peer's memory (process_vm_readv), which the peer reads before sending large messages.
  std::unique_ptr<PeerLink> connect(int peer, const std::string& peer_name, int64_t peer_pid);
  void unlink_name() { own_.unlink(); }
  // What peers pass to connect() to map this inbox (valid until unlink_name()).
  const std::string& inbox_name() const { return own_.name(); }

  uint32_t begin_sleep() override;
  void sleep(uint32_t token, int64_t timeout_us) override;
  void end_sleep() override;
  void wake() override;

 private:
  int rank_;
  int nranks_;
  ShmSegment own_;
  InboxView own_view_;
  std::vector<ShmSegment> peers_;
};

}  // namespace linkwise
