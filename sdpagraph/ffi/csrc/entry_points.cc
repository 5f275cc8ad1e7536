// sdpagraph executor: runs serialized cuDNN frontend graphs from XLA through the typed FFI.
//
// XLA calls `sdpagraph_execute` with the graph's operands, its results, the workspace as the last
// result, and the graph key as an attribute. The executor finds the serialized graph (registered
// from Python, or read from the disk-cache entry file named by the call), deserializes it once per
// device, and executes it on XLA's stream with XLA's workspace. loader.py documents the call
// contract for the Python side.
//
// Files (all in this directory):
//   errors.h                 how failures travel to the handler boundary
//   cudnn_library.{h,cc}     binding the frontend to the libcudnn JAX already loaded; status checks
//   stream_capture.{h,cc}    keeping one-time setup legal while XLA records a command buffer
//   msgpack_reader.h         a bounds-checked msgpack reader
//   entry_file.{h,cc}        cache entry files: CRC-32, entry verification
//   handles.{h,cc}           cuDNN handles, one per (device, thread), for the life of the process
//   graph_registry.{h,cc}    key -> serialized blob -> one deserialized graph per device
//   host_timing.h            the handler's host time, for benchmarks
//   variant_pack.{h,cc}      ordering a call's tensor pointers the way a graph takes them
//   execute.cc               the XLA FFI handler (`sdpagraph_execute`)
//   direct.{h,cc}            a graph run once outside XLA, for the numerical check
//   entry_points.{h,cc}      what loader.py and direct.py call through ctypes (this file)
#include "entry_points.h"

#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "cudnn_frontend_version.h"
#include "cudnn_library.h"
#include "direct.h"
#include "entry_file.h"
#include "errors.h"
#include "graph_registry.h"
#include "host_timing.h"
#include "variant_pack.h"

namespace sdpagraph {
namespace {

// Status codes of the C entry points; loader.py maps them to messages.
enum EntryPointStatus : int {
  kStatusOk = 0,
  kStatusInvalidKey = 1,    // not a 64-digit lowercase hex digest
  kStatusEmptyBlob = 2,     // null or empty blob
  kStatusEntryInvalid = 3,  // the cache entry file cannot be used (reason in the error buffer)
  kStatusInternal = 4,      // out of memory or another unexpected failure
};

// Writes `message` NUL-terminated (truncated to `size`) to `buffer`, for the C entry points.
void ReportError(char* buffer, size_t size, const char* message) {
  if (buffer != nullptr && size > 0) {
    std::strncpy(buffer, message, size - 1);
    buffer[size - 1] = '\0';
  }
}

// Runs `body` for a direct-run entry point: its status code, and the reason in `error` on failure.
template <typename Body>
int GuardedEntry(char* error, size_t error_size, Body&& body) {
  try {
    body();
    return kStatusOk;
  } catch (const std::exception& failure) {
    ReportError(error, error_size, failure.what());
  } catch (...) {
    ReportError(error, error_size, "unknown exception");
  }
  return kStatusInternal;
}

}  // namespace
}  // namespace sdpagraph

// The C entry points. None of them lets an exception out: each catches and answers with a status
// code. (The FFI handler, sdpagraph_execute, is in execute.cc and answers with an ffi::Error.)

// Registers a serialized graph under its key. Idempotent: a key keeps its first blob.
SDPAGRAPH_EXPORT int sdpagraph_register_graph(const char* key_digest, const uint8_t* blob, size_t size) {
  if (key_digest == nullptr || !sdpagraph::IsGraphKey(key_digest)) return sdpagraph::kStatusInvalidKey;
  if (blob == nullptr || size == 0) return sdpagraph::kStatusEmptyBlob;
  try {
    sdpagraph::State().graphs.Insert(key_digest, std::vector<uint8_t>(blob, blob + size));
    return sdpagraph::kStatusOk;
  } catch (...) {
    return sdpagraph::kStatusInternal;
  }
}

// Verifies the cache entry file at `path` and registers its graph under `key_digest`, as the
// handler does on a registry miss; on failure writes the reason (NUL-terminated, truncated to
// `error_size`) to `error`. Lets the Python side preload entries and test the file reader.
SDPAGRAPH_EXPORT int sdpagraph_register_entry_file(const char* key_digest, const char* path, char* error,
                                                   size_t error_size) {
  if (key_digest == nullptr || !sdpagraph::IsGraphKey(key_digest)) return sdpagraph::kStatusInvalidKey;
  const auto report = [&](const char* message) { sdpagraph::ReportError(error, error_size, message); };
  try {
    sdpagraph::State().graphs.Insert(key_digest, sdpagraph::ReadEntryBlob(path == nullptr ? "" : path, key_digest));
    return sdpagraph::kStatusOk;
  } catch (const sdpagraph::EntryFileError& failure) {
    report(failure.what());
    return sdpagraph::kStatusEntryInvalid;
  } catch (const std::exception& failure) {
    report(failure.what());
    return sdpagraph::kStatusInternal;
  } catch (...) {
    report("unknown exception");
    return sdpagraph::kStatusInternal;
  }
}

// Direct runs (direct.h): device memory for the numerical check, copies, and one synchronous run.
// Each returns kStatusOk, or kStatusInternal with the reason in `error`.

// Allocates `bytes` of zero-filled device memory on `device`.
SDPAGRAPH_EXPORT int sdpagraph_device_alloc(int device, size_t bytes, void** pointer, char* error,
                                            size_t error_size) {
  return sdpagraph::GuardedEntry(error, error_size, [&] {
    sdpagraph::BindCudnnLibrary();
    sdpagraph::UseDevice(device);
    *pointer = nullptr;
    if (bytes == 0) return;
    sdpagraph::DeviceBuffer buffer(bytes);  // freed if zero-filling fails
    sdpagraph::OwnedStream stream;
    sdpagraph::CheckCuda(cudnn_frontend::detail::cuda_mem_set_async(buffer.get(), 0, bytes, stream.get()),
                         "cudaMemsetAsync");
    stream.Synchronize();
    *pointer = buffer.Release();
  });
}

SDPAGRAPH_EXPORT int sdpagraph_device_free(int device, void* pointer, char* error, size_t error_size) {
  return sdpagraph::GuardedEntry(error, error_size, [&] {
    sdpagraph::UseDevice(device);
    if (pointer != nullptr) sdpagraph::CheckCuda(cudnn_frontend::detail::cuda_free(pointer), "cudaFree");
  });
}

// Makes `count` copies (destinations[i] <- sources[i], bytes[i] each) and waits for them all: `kind`
// 0 device to host, 1 host to device, 2 device to device.
SDPAGRAPH_EXPORT int sdpagraph_device_copy(int device, size_t count, void* const* destinations,
                                           const void* const* sources, const size_t* bytes, int kind, char* error,
                                           size_t error_size) {
  return sdpagraph::GuardedEntry(error, error_size, [&] {
    constexpr cudaMemcpyKind kKinds[] = {cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToDevice};
    if (kind < 0 || kind > 2) throw sdpagraph::InvalidCallError("copy kind must be 0, 1 or 2");
    sdpagraph::UseDevice(device);
    if (count > 0) sdpagraph::CopyAllSync(count, destinations, sources, bytes, kKinds[kind]);
  });
}

// Runs the graph registered under `key_digest` once: `count` tensors (uid, device pointer) and
// `scalar_count` pass-by-value scalars (uid, 4-byte host value), as the FFI handler binds them.
SDPAGRAPH_EXPORT int sdpagraph_run_graph(const char* key_digest, int device, size_t count, const int64_t* uids,
                                         void* const* pointers, size_t scalar_count, const int64_t* scalar_uids,
                                         const uint32_t* scalar_words, char* error, size_t error_size) {
  if (key_digest == nullptr || !sdpagraph::IsGraphKey(key_digest)) return sdpagraph::kStatusInvalidKey;
  return sdpagraph::GuardedEntry(error, error_size, [&] {
    std::vector<sdpagraph::TensorPointer> given;
    given.reserve(count + scalar_count);
    for (size_t i = 0; i < count; ++i) given.push_back({uids[i], pointers[i]});
    for (size_t i = 0; i < scalar_count; ++i) {
      given.push_back({scalar_uids[i], const_cast<uint32_t*>(scalar_words + i)});
    }
    sdpagraph::RunDirect(key_digest, device, given);
  });
}

// Deserializes the graph registered under `key_digest` for `device` now, so that its first call
// finds it ready. A no-op when it already is.
SDPAGRAPH_EXPORT int sdpagraph_prepare_graph(const char* key_digest, int device, char* error, size_t error_size) {
  if (key_digest == nullptr || !sdpagraph::IsGraphKey(key_digest)) return sdpagraph::kStatusInvalidKey;
  return sdpagraph::GuardedEntry(error, error_size, [&] { sdpagraph::PrepareDirect(key_digest, device); });
}

// Total graph deserializations in this process, over all keys and devices (for tests).
SDPAGRAPH_EXPORT int64_t sdpagraph_deserialize_count(void) {
  return sdpagraph::State().deserialize_count.load(std::memory_order_relaxed);
}

// Writes the host-timing totals since the last call (calls, handler ns, ns inside the frontend's
// execute) to `totals[0..2]`, resets them, and turns timing on (`enable` != 0) or off. Returns 1 when
// timing was on until now.
SDPAGRAPH_EXPORT int sdpagraph_host_timing(int enable, int64_t* totals) {
  const sdpagraph::HostTiming::Totals taken = sdpagraph::State().timing.Take(enable != 0);
  if (totals != nullptr) {
    totals[0] = taken.calls;
    totals[1] = taken.handler_ns;
    totals[2] = taken.cudnn_execute_ns;
  }
  return taken.was_enabled ? 1 : 0;
}

// 1 when sdpagraph_execute carries XLA's command-buffer-compatible trait in this build.
SDPAGRAPH_EXPORT int sdpagraph_command_buffer_compatible(void) { return SDPAGRAPH_COMMAND_BUFFER_COMPATIBLE; }

#define SDPAGRAPH_STRINGIFY_(x) #x
#define SDPAGRAPH_STRINGIFY(x) SDPAGRAPH_STRINGIFY_(x)

// The executor version and the header versions it was compiled against.
SDPAGRAPH_EXPORT const char* sdpagraph_version(void) {
  return "sdpagraph-executor 0.1.0 (cudnn-frontend " SDPAGRAPH_STRINGIFY(CUDNN_FRONTEND_MAJOR_VERSION) "."
         SDPAGRAPH_STRINGIFY(CUDNN_FRONTEND_MINOR_VERSION) "." SDPAGRAPH_STRINGIFY(CUDNN_FRONTEND_PATCH_VERSION)
         ", cuDNN headers " SDPAGRAPH_STRINGIFY(CUDNN_MAJOR) "." SDPAGRAPH_STRINGIFY(CUDNN_MINOR) "."
         SDPAGRAPH_STRINGIFY(CUDNN_PATCHLEVEL) ", CUDA headers " SDPAGRAPH_STRINGIFY(CUDART_VERSION) ")";
}
