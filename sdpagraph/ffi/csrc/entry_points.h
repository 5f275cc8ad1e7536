// The library's exported C entry points: the XLA FFI handler (defined in execute.cc) and what
// loader.py and direct.py call through ctypes (defined, and documented, in entry_points.cc, which
// also gives the overview of the executor and its files).
#ifndef SDPAGRAPH_FFI_CSRC_ENTRY_POINTS_H_
#define SDPAGRAPH_FFI_CSRC_ENTRY_POINTS_H_

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/c_api.h"

#ifndef SDPAGRAPH_COMMAND_BUFFER_COMPATIBLE
#define SDPAGRAPH_COMMAND_BUFFER_COMPATIBLE 1
#endif

// The library is built with hidden visibility; only these entry points are exported.
#define SDPAGRAPH_EXPORT extern "C" __attribute__((visibility("default")))

SDPAGRAPH_EXPORT XLA_FFI_Error* sdpagraph_execute(XLA_FFI_CallFrame* call_frame);

SDPAGRAPH_EXPORT int sdpagraph_register_graph(const char* key_digest, const uint8_t* blob, size_t size);
SDPAGRAPH_EXPORT int sdpagraph_register_entry_file(const char* key_digest, const char* path, char* error,
                                                   size_t error_size);

SDPAGRAPH_EXPORT int sdpagraph_device_alloc(int device, size_t bytes, void** pointer, char* error,
                                            size_t error_size);
SDPAGRAPH_EXPORT int sdpagraph_device_free(int device, void* pointer, char* error, size_t error_size);
SDPAGRAPH_EXPORT int sdpagraph_device_copy(int device, size_t count, void* const* destinations,
                                           const void* const* sources, const size_t* bytes, int kind, char* error,
                                           size_t error_size);
SDPAGRAPH_EXPORT int sdpagraph_run_graph(const char* key_digest, int device, size_t count, const int64_t* uids,
                                         void* const* pointers, size_t scalar_count, const int64_t* scalar_uids,
                                         const uint32_t* scalar_words, char* error, size_t error_size);

SDPAGRAPH_EXPORT int64_t sdpagraph_deserialize_count(void);
SDPAGRAPH_EXPORT int sdpagraph_host_timing(int enable, int64_t* totals);
SDPAGRAPH_EXPORT int sdpagraph_command_buffer_compatible(void);
SDPAGRAPH_EXPORT const char* sdpagraph_version(void);

#endif  // SDPAGRAPH_FFI_CSRC_ENTRY_POINTS_H_
