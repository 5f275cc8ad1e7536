// Cache entry files: CRC-32, entry verification (the msgpack reader is in msgpack_reader.h).
//
// Layout (written by the Python disk cache):
//   8 bytes  magic "SDPAGRPH"
//   u32 LE   format version (1)
//   u32 LE   CRC-32 of the payload (zlib.crc32)
//   payload  one msgpack map with string keys, among them "key_hash" (str) and "blob" (bin)
#include "entry_file.h"

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>

#include "errors.h"
#include "msgpack_reader.h"

namespace sdpagraph {
namespace {

constexpr std::array<char, 8> kEntryMagic = {'S', 'D', 'P', 'A', 'G', 'R', 'P', 'H'};
constexpr uint32_t kEntryFormatVersion = 1;
constexpr size_t kEntryHeaderSize = kEntryMagic.size() + 2 * sizeof(uint32_t);

// zlib's CRC-32 (reflected IEEE polynomial, initial value and final xor 0xFFFFFFFF), so that what
// Python's zlib.crc32 wrote is what this checks.
uint32_t Crc32(const uint8_t* data, size_t size) {
  static constexpr std::array<uint32_t, 256> kTable = [] {
    std::array<uint32_t, 256> table{};
    for (uint32_t byte = 0; byte < table.size(); ++byte) {
      uint32_t crc = byte;
      for (int bit = 0; bit < 8; ++bit) {
        crc = (crc & 1u) ? (0xEDB88320u ^ (crc >> 1)) : (crc >> 1);
      }
      table[byte] = crc;
    }
    return table;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) {
    crc = kTable[(crc ^ data[i]) & 0xFFu] ^ (crc >> 8);
  }
  return crc ^ 0xFFFFFFFFu;
}

uint32_t ReadLittleEndian32(const uint8_t* bytes) {
  return static_cast<uint32_t>(bytes[0]) | (static_cast<uint32_t>(bytes[1]) << 8) |
         (static_cast<uint32_t>(bytes[2]) << 16) | (static_cast<uint32_t>(bytes[3]) << 24);
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    throw EntryFileError(std::string("cannot open: ") + std::strerror(errno));
  }
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) {
    throw EntryFileError("read error");
  }
  return bytes;
}

}  // namespace

std::vector<uint8_t> ReadEntryBlob(const std::string& path, std::string_view expected_key) {
  const std::vector<uint8_t> file = ReadFile(path);
  if (file.size() < kEntryHeaderSize) {
    throw EntryFileError("file is too short to be a cache entry");
  }
  if (std::memcmp(file.data(), kEntryMagic.data(), kEntryMagic.size()) != 0) {
    throw EntryFileError("not a cache entry (bad magic)");
  }
  const uint32_t version = ReadLittleEndian32(file.data() + kEntryMagic.size());
  if (version != kEntryFormatVersion) {
    throw EntryFileError("unsupported format version " + std::to_string(version));
  }
  const uint32_t stored_crc = ReadLittleEndian32(file.data() + kEntryMagic.size() + 4);
  const uint8_t* payload = file.data() + kEntryHeaderSize;
  const size_t payload_size = file.size() - kEntryHeaderSize;
  if (Crc32(payload, payload_size) != stored_crc) {
    throw EntryFileError("checksum mismatch");
  }

  MsgpackReader reader(payload, payload_size);
  std::optional<std::string_view> key_hash;
  std::optional<ByteRange> blob;
  for (uint64_t remaining = reader.ReadMapHeader(); remaining > 0; --remaining) {
    if (!reader.NextIsString()) {
      reader.SkipValue();  // a non-string key and its value belong to no field this reader needs
      reader.SkipValue();
      continue;
    }
    const std::string_view field = reader.ReadString();
    if (field == "key_hash") {
      key_hash = reader.ReadString();
    } else if (field == "blob") {
      blob = reader.ReadBinary();
    } else {
      reader.SkipValue();
    }
  }
  if (!key_hash) {
    throw EntryFileError("entry has no key_hash");
  }
  if (*key_hash != expected_key) {
    throw EntryFileError("entry is for graph " + std::string(*key_hash));
  }
  if (!blob || blob->size == 0) {
    throw EntryFileError("entry has no blob");
  }
  return std::vector<uint8_t>(blob->data, blob->data + blob->size);
}

}  // namespace sdpagraph
