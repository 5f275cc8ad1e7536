// The bounds-checked msgpack reader of cache entry files (entry_file.cc).
#ifndef SDPAGRAPH_FFI_CSRC_MSGPACK_READER_H_
#define SDPAGRAPH_FFI_CSRC_MSGPACK_READER_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "errors.h"

namespace sdpagraph {

struct ByteRange {
  const uint8_t* data;
  size_t size;
};

// Reads the msgpack an entry needs (a map, str keys, str and bin values) and skips any other value.
// Every length is checked against the end of the payload, so a corrupt or hostile file gives an
// EntryFileError, never a read out of bounds.
class MsgpackReader {
 public:
  MsgpackReader(const uint8_t* data, size_t size) : cursor_(data), end_(data + size) {}

  uint64_t ReadMapHeader() {
    const uint8_t tag = ReadByte();
    if ((tag & 0xF0u) == 0x80u) return tag & 0x0Fu;
    if (tag == 0xDE) return ReadBigEndian(2);
    if (tag == 0xDF) return ReadBigEndian(4);
    throw EntryFileError("payload is not a msgpack map");
  }

  bool NextIsString() const {
    if (cursor_ == end_) return false;
    const uint8_t tag = *cursor_;
    return (tag & 0xE0u) == 0xA0u || tag == 0xD9 || tag == 0xDA || tag == 0xDB;
  }

  std::string_view ReadString() {
    const uint8_t tag = ReadByte();
    uint64_t length = 0;
    if ((tag & 0xE0u) == 0xA0u) {
      length = tag & 0x1Fu;
    } else if (tag >= 0xD9 && tag <= 0xDB) {
      length = ReadBigEndian(size_t{1} << (tag - 0xD9));
    } else {
      throw EntryFileError("msgpack value is not a string");
    }
    const uint8_t* bytes = Take(length);
    return {reinterpret_cast<const char*>(bytes), static_cast<size_t>(length)};
  }

  ByteRange ReadBinary() {
    const uint8_t tag = ReadByte();
    if (tag < 0xC4 || tag > 0xC6) {
      throw EntryFileError("msgpack value is not binary data");
    }
    const uint64_t length = ReadBigEndian(size_t{1} << (tag - 0xC4));
    return {Take(length), static_cast<size_t>(length)};
  }

  // Skips one complete value of any type. Iterative, so nesting depth cannot exhaust the stack: each
  // container adds its element count to `pending`, and every step consumes at least one byte.
  void SkipValue() {
    uint64_t pending = 1;
    while (pending > 0) {
      --pending;
      const uint8_t tag = ReadByte();
      if (tag <= 0x7F || tag >= 0xE0 || tag == 0xC0 || tag == 0xC2 || tag == 0xC3) {
        continue;  // fixint, nil, false, true: the tag is the whole value
      }
      if ((tag & 0xF0u) == 0x80u) {
        pending += 2u * (tag & 0x0Fu);  // fixmap
        continue;
      }
      if ((tag & 0xF0u) == 0x90u) {
        pending += tag & 0x0Fu;  // fixarray
        continue;
      }
      if ((tag & 0xE0u) == 0xA0u) {
        Take(tag & 0x1Fu);  // fixstr
        continue;
      }
      switch (tag) {
        case 0xC4: case 0xD9: Take(ReadBigEndian(1)); break;       // bin8, str8
        case 0xC5: case 0xDA: Take(ReadBigEndian(2)); break;       // bin16, str16
        case 0xC6: case 0xDB: Take(ReadBigEndian(4)); break;       // bin32, str32
        case 0xC7: Take(ReadBigEndian(1) + 1); break;              // ext8: length, type, data
        case 0xC8: Take(ReadBigEndian(2) + 1); break;              // ext16
        case 0xC9: Take(ReadBigEndian(4) + 1); break;              // ext32
        case 0xCA: Take(4); break;                                 // float32
        case 0xCB: Take(8); break;                                 // float64
        case 0xCC: case 0xD0: Take(1); break;                      // uint8, int8
        case 0xCD: case 0xD1: Take(2); break;                      // uint16, int16
        case 0xCE: case 0xD2: Take(4); break;                      // uint32, int32
        case 0xCF: case 0xD3: Take(8); break;                      // uint64, int64
        case 0xD4: Take(2); break;                                 // fixext1: type, data
        case 0xD5: Take(3); break;                                 // fixext2
        case 0xD6: Take(5); break;                                 // fixext4
        case 0xD7: Take(9); break;                                 // fixext8
        case 0xD8: Take(17); break;                                // fixext16
        case 0xDC: pending += ReadBigEndian(2); break;             // array16
        case 0xDD: pending += ReadBigEndian(4); break;             // array32
        case 0xDE: pending += 2 * ReadBigEndian(2); break;         // map16
        case 0xDF: pending += 2 * ReadBigEndian(4); break;         // map32
        default: throw EntryFileError("invalid msgpack byte 0xc1");  // the one unused tag
      }
    }
  }

 private:
  const uint8_t* Take(uint64_t count) {
    if (count > static_cast<uint64_t>(end_ - cursor_)) {
      throw EntryFileError("msgpack payload is truncated");
    }
    const uint8_t* start = cursor_;
    cursor_ += count;
    return start;
  }

  uint8_t ReadByte() { return *Take(1); }

  uint64_t ReadBigEndian(size_t byte_count) {
    const uint8_t* bytes = Take(byte_count);
    uint64_t value = 0;
    for (size_t i = 0; i < byte_count; ++i) {
      value = (value << 8) | bytes[i];
    }
    return value;
  }

  const uint8_t* cursor_;
  const uint8_t* end_;
};

}  // namespace sdpagraph

#endif  // SDPAGRAPH_FFI_CSRC_MSGPACK_READER_H_
