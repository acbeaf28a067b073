// Element type codes for message headers. A code is (kind << 8) | itemsize, where kind is
// 'i' signed, 'u' unsigned, 'f' floating, 'c' complex, 'b' bool, 'V' anything else, with
// kSwappedBytes set for numbers in the byte order that is not this machine's: '>i4' and
// '<i4' differ, so a message never lands byte-swapped (both ranks of a job run on hosts of
// one byte order).
// Unsigned bytes ('B', as bytes/bytearray/uint8 give) are "untyped" (code 0): raw bytes
// may be received into anything and anything into raw bytes.
// 'V' codes (records, strings, long double) also carry a 12-bit hash of the whole format
// string and item size in bits 17-28, so that two record layouts of one size, or records of
// 256 and 512 bytes, do not match. A hash can collide (1 in 4096): the check is a guard
// against mistakes, not a proof.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "core/reduce.h"
#include "p2p/engine.h"

namespace linkwise {

namespace {

constexpr int kLayoutShift = 17;
constexpr uint32_t kLayoutMask = 0xfffu << kLayoutShift;

// Bits 17-28 of a 'V' code (0 for the numeric kinds): FNV-1a over the format and the size.
uint32_t record_layout(char kind, const char* format, size_t itemsize) {
  if (kind != 'V') return 0;
  uint32_t h = 2166136261u;
  for (const char* c = format; *c; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 16777619u;
  for (int i = 0; i < 8; ++i) h = (h ^ ((itemsize >> (8 * i)) & 0xff)) * 16777619u;
  return ((h ^ (h >> 12) ^ (h >> 24)) << kLayoutShift) & kLayoutMask;
}

}  // namespace

uint32_t dtype_code(const char* format, size_t itemsize) {
  if (!format) return 0;
  bool swapped = false;  // the buffer's byte order is not this machine's ('>i' here on x86)
  for (; *format && std::strchr("@=<>!", *format); ++format) {
    const bool big = *format == '>' || *format == '!';
    if (*format != '@' && *format != '=') swapped = big != (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__);
  }
  char f = *format;
  if (f == 'B' || f == 0) return 0;
  char kind;
  if (std::strchr("bhilq", f)) kind = 'i';
  else if (std::strchr("HILQ", f)) kind = 'u';
  else if (std::strchr("efd", f)) kind = 'f';
  else if (f == 'Z') kind = 'c';
  else if (f == '?') kind = 'b';
  else kind = 'V';
  const uint32_t order = swapped && itemsize > 1 && kind != 'V' ? kSwappedBytes : 0;
  const uint32_t size = static_cast<uint32_t>(itemsize < 0xff ? itemsize : 0xff);
  return order | record_layout(kind, format, itemsize) | (static_cast<uint32_t>(kind) << 8) | size;
}

bool dtypes_compatible(uint32_t a, uint32_t b) { return a == 0 || b == 0 || a == b; }

std::string dtype_name(uint32_t code) {
  if (code == 0) return "untyped bytes";
  if (code & kCollCode) {  // a collective's (collective_code)
    const unsigned t = (code >> 20) & 15, op = (code >> 16) & 15;
    if (t < static_cast<unsigned>(DType::kCount) && op < static_cast<unsigned>(RedOp::kCount))
      return std::string(dtype_str(static_cast<DType>(t))) + " (" + redop_str(static_cast<RedOp>(op)) + ")";
    return "bytes";
  }
  if (code & kSwappedBytes) return dtype_name(code & ~kSwappedBytes) + " in the other byte order";
  char kind = static_cast<char>(code >> 8);
  unsigned bits = (code & 0xff) * 8;
  switch (kind) {
    case 'i': return "int" + std::to_string(bits);
    case 'u': return "uint" + std::to_string(bits);
    case 'f': return "float" + std::to_string(bits);
    case 'c': return "complex" + std::to_string(bits);
    case 'b': return "bool";
    default: {
      const unsigned size = code & 0xff;
      char layout[8];
      std::snprintf(layout, sizeof layout, "%03x", (code & kLayoutMask) >> kLayoutShift);
      return (size == 0xff ? std::string("records of 255 bytes or more") : std::to_string(size) + "-byte records") +
             " (layout " + layout + ")";
    }
  }
}

}  // namespace linkwise
