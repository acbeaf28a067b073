// Cross Memory Attach: copies between this process and a peer process of the same host
// (process_vm_readv / process_vm_writev), one copy by the kernel, no shared mapping needed.
// Used by the shared-memory transport (large messages) and the shared-memory collectives.
//
// Permission: the kernel checks ptrace-attach rights on the peer (same uid, and under the
// Yama LSM the peer must allow us: cma_allow_peers() lets any process of ours' uid attach).
// Containers or hardened kernels may still refuse, so users probe first (cma_probe) and keep
// a fallback path that copies through shared memory.
// Threading: all functions are thread-safe (no state).
#pragma once

#include <cstddef>
#include <cstdint>

namespace linkwise {

// Lets peers (not only our ancestors) read and write our memory where Yama restricts
// ptrace-class access (PR_SET_PTRACER_ANY). Harmless elsewhere; idempotent.
void cma_allow_peers();

// True when this process can read `pid`'s memory at `addr` and finds `expect` there.
bool cma_probe(int64_t pid, const void* addr, uint64_t expect);

// Copies n bytes from `remote` in pid's address space to `local` (cma_read), or from `local`
// to `remote` (cma_write). Retries short copies and EINTR. A dead peer (ESRCH) or memory
// that vanished throws Error(Peer) naming peer_rank; other failures throw Internal.
void cma_read(int64_t pid, int peer_rank, void* local, uint64_t remote, size_t n);
void cma_write(int64_t pid, int peer_rank, uint64_t remote, const void* local, size_t n);

}  // namespace linkwise
