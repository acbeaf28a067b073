#include "core/copy.h"

#include <atomic>
#include <cstring>
#if defined(__SSE2__)
#include <cpuid.h>
#include <emmintrin.h>
#endif

namespace linkwise {

namespace {
std::atomic<uint64_t> vector_copies{0}, cma_bounces{0};

bool amd_cpu() {
#if defined(__SSE2__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  return ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
#else
  return false;
#endif
}

std::atomic<bool> detour{amd_cpu()};
}  // namespace

void set_copy_detour(int mode) { detour.store(mode < 0 ? amd_cpu() : mode > 0, std::memory_order_relaxed); }

bool copy_detour_on() { return detour.load(std::memory_order_relaxed); }

CopyDetours copy_detours() {
  return {vector_copies.load(std::memory_order_relaxed), cma_bounces.load(std::memory_order_relaxed)};
}

void count_cma_bounce() { cma_bounces.fetch_add(1, std::memory_order_relaxed); }

void copy_bytes(void* dst, const void* src, size_t n) {
#if defined(__SSE2__)
  if (n >= 1024 && copy_aliases(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src)) &&
      copy_detour_on()) {
    vector_copies.fetch_add(1, std::memory_order_relaxed);
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {  // all four loads before the stores: no load waits on them
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    std::memcpy(d + i, s + i, n - i);  // under 64 bytes: no string copy
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace linkwise
