// Cache entry files: reading and verifying the disk-cache entry the Python side wrote for a graph
// (layout in entry_file.cc).
#ifndef SDPAGRAPH_FFI_CSRC_ENTRY_FILE_H_
#define SDPAGRAPH_FFI_CSRC_ENTRY_FILE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace sdpagraph {

// Verifies the entry at `path` and returns its serialized graph. Throws EntryFileError with the
// reason (without the path) when the file cannot be used.
std::vector<uint8_t> ReadEntryBlob(const std::string& path, std::string_view expected_key);

}  // namespace sdpagraph

#endif  // SDPAGRAPH_FFI_CSRC_ENTRY_FILE_H_
