// Byte copies between buffers whose addresses the caller does not choose (user arrays, ring
// slots, a peer's memory), safe from one pathological case of x86 string copies.
//
// Why: `rep movsb` (what glibc's memcpy uses for mid-sized copies on CPUs with fast strings, and
// what the kernel uses in process_vm_readv/writev) runs several times slower on some CPUs when
// the destination lies a few bytes past the source modulo 4 KiB: each load then aliases a
// store just issued. Measured on the 2-core VM's AMD EPYC (bench/copy_alias.cc; 8 MiB in
// 256 KiB copies): memcpy 0.45 ms at distance 0 and 4.6 ms at distance 16, process_vm_readv
// 1.4 ms and 5.9 ms; distances 4-28 were slow, 32 and more were not. Fresh NumPy arrays of
// 128 KiB and more sit 16 bytes into a page, so copying into one from a page-aligned ring slot,
// or between arrays placed alike on two ranks, hits it routinely (docs/benchmarks.md,
// fourteenth session). The GPU machines' Intel Xeon showed no penalty at any distance, so the
// detours are on for AMD CPUs only unless set_copy_detour says otherwise
// (LINKWISE_COPY_DETOUR).
//
// Threading: every function may be called from any thread. Process-wide state: the detour flag
// and two statistics counters (relaxed atomics); the CMA bounce buffers (cma.cc) are per
// thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace linkwise {

// True when a string copy from src to dst would alias (see above): dst is 1-31 bytes past src
// modulo 4 KiB. (Routing 32-63 around the string copy too cost ~1.3x there.)
inline bool copy_aliases(uintptr_t dst, uintptr_t src) {
  const uintptr_t d = (dst - src) & 4095;
  return d != 0 && d < 32;
}

// Whether aliasing copies take the detours: -1 = by CPU (AMD: yes), 0 = never, 1 = always.
// Process-wide; set before the transfers it should affect (a relaxed flag: a copy running
// while it changes takes either way, both correct).
void set_copy_detour(int mode);
bool copy_detour_on();

// memcpy(dst, src, n) for non-overlapping buffers; where the detours are on, an aliasing copy
// of 1 KiB or more runs as a vector loop instead of the string copy.
void copy_bytes(void* dst, const void* src, size_t n);

// How many copies took the detours so far in this process (copy_bytes' vector loop, the CMA
// bounce of cma.cc): tests check that their aliasing buffers reached them. Relaxed counters,
// touched only on the detours.
struct CopyDetours {
  uint64_t vector_copies;
  uint64_t cma_bounces;
};
CopyDetours copy_detours();
void count_cma_bounce();

}  // namespace linkwise
