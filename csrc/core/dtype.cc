// Element type codes for message headers. A code is (kind << 8) | itemsize, where kind is
// 'i' signed, 'u' unsigned, 'f' floating, 'c' complex, 'b' bool, 'V' anything else, with
// kSwappedBytes set for numbers in the byte order that is not this machine's: '>i4' and
// '<i4' differ, so a message never lands byte-swapped (both ranks of a job run on hosts of
// one byte order).
// Unsigned bytes ('B', as bytes/bytearray/uint8 give) are "untyped" (code 0): raw bytes
// may be received into anything and anything into raw bytes.
// 'V' codes (records, strings, long double) carry the item size in bits 0-7 and 17-22 (exact
// up to 16383 bytes) and, for structured records (format "T{...}"), a 7-bit hash of their
// layout in bits 23-29: the format without field names and native byte-order marks, so that
// [('x','f8'),('y','f8')] and [('a','f8'),('b','f8')], or the same struct from NumPy and from
// ctypes, match. Layout 0 is a record without fields (void 'V16', bytes 'S16', long double):
// it matches any 'V' code of its size, as raw bytes would. A hash can collide (1 in 127): the
// check guards against mistakes, it proves nothing.
#include <cstdint>
#include <cstring>
#include <string>

#include "core/reduce.h"
#include "p2p/engine.h"

namespace linkwise {

namespace {

constexpr int kSizeHighShift = 17, kLayoutShift = 23;
constexpr uint32_t kSizeHighMask = 0x3fu << kSizeHighShift, kLayoutMask = 0x7fu << kLayoutShift;

bool native_order_mark(char c) {
  const char native = __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__ ? '>' : '<';
  return c == '@' || c == '=' || c == native;
}

// Bits 17-29 of a 'V' code (0 for the numeric kinds; see the file's comment).
uint32_t record_bits(char kind, const char* format, size_t itemsize) {
  if (kind != 'V') return 0;
  uint32_t layout = 0;
  if (format[0] == 'T' && format[1] == '{') {
    uint32_t h = 2166136261u;  // FNV-1a over the format, names (":name:") and native marks left out
    bool in_name = false;
    for (const char* c = format; *c; ++c) {
      if (*c == ':') { in_name = !in_name; continue; }
      if (in_name || native_order_mark(*c)) continue;
      h = (h ^ static_cast<unsigned char>(*c)) * 16777619u;
    }
    layout = (h ^ (h >> 7) ^ (h >> 14) ^ (h >> 21)) % 127 + 1;  // 1..127: 0 is "no fields"
  }
  return (static_cast<uint32_t>((itemsize >> 8) & 0x3f) << kSizeHighShift) | (layout << kLayoutShift);
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
  return order | record_bits(kind, format, itemsize) | (static_cast<uint32_t>(kind) << 8) |
         static_cast<uint32_t>(itemsize & 0xff);
}

bool dtypes_compatible(uint32_t a, uint32_t b) {
  if (a == 0 || b == 0 || a == b) return true;
  // Two records of one size where either has no fields (its layout bits 0): raw bytes.
  const bool records = (a & kCollCode) == 0 && (b & kCollCode) == 0 && ((a >> 8) & 0xff) == 'V' &&
                       ((b >> 8) & 0xff) == 'V';
  return records && (a & ~kLayoutMask) == (b & ~kLayoutMask) && ((a & kLayoutMask) == 0 || (b & kLayoutMask) == 0);
}

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
      const unsigned size = (code & 0xff) | (((code & kSizeHighMask) >> kSizeHighShift) << 8);
      const unsigned layout = (code & kLayoutMask) >> kLayoutShift;
      return std::to_string(size) + "-byte records" + (layout ? " (layout " + std::to_string(layout) + ")" : "");
    }
  }
}

}  // namespace linkwise
