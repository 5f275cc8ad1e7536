// sdpagraph executor: runs serialized cuDNN frontend graphs from XLA through the typed FFI.
//
// XLA calls `sdpagraph_execute` with the graph's operands, its results, the workspace as the last
// result, and the graph key as an attribute. The executor finds the serialized graph (registered
// from Python, or read from the disk-cache entry file named by the call), deserializes it once per
// device, and executes it on XLA's stream with XLA's workspace. loader.py documents the call
// contract for the Python side.
//
// Sections:
//   1. Errors             how failures travel to the handler boundary
//   2. cuDNN library      binding the frontend to the libcudnn JAX already loaded
//   3. Stream capture     keeping one-time setup legal while XLA records a command buffer
//   4. Cache entry files  CRC-32, a bounds-checked msgpack reader, entry verification
//   5. cuDNN handles      one per (device, thread), for the life of the process
//   6. Graph registry     key -> serialized blob -> one deserialized graph per device
//   7. Execute handler    the XLA FFI handler
//   8. Direct runs        a graph run once outside XLA, for the numerical check
//   9. C entry points     what loader.py and direct.py call through ctypes

#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cudnn_frontend.h"
#include "cudnn_frontend_version.h"
#include "xla/ffi/api/ffi.h"

#ifndef SDPAGRAPH_COMMAND_BUFFER_COMPATIBLE
#define SDPAGRAPH_COMMAND_BUFFER_COMPATIBLE 1
#endif

// The library is built with hidden visibility; only these entry points are exported.
#define SDPAGRAPH_EXPORT extern "C" __attribute__((visibility("default")))

namespace cudnn_frontend {
// With NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING the frontend resolves every cuDNN function with
// dlsym(cudnn_dlhandle, ...) and leaves defining and setting this handle to the embedding library.
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace sdpagraph {
namespace {

namespace ffi = xla::ffi;
namespace fe_detail = cudnn_frontend::detail;

// ===================================================================================================
// 1. Errors
// ===================================================================================================
// Failures are thrown inside the executor and turned into ffi::Error at the handler boundary (or a
// status code at the C entry points), because the frontend itself throws: std::runtime_error for a
// missing cuDNN or CUDA symbol, nlohmann::json exceptions for a malformed blob.

// A failure of cuDNN, CUDA or the graph itself.
class ExecutorError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A call that breaks the contract loader.py documents (uid counts, workspace size, ...).
class InvalidCallError : public ExecutorError {
 public:
  using ExecutorError::ExecutorError;
};

// A cache entry file that cannot be used; the message is the reason, without the path.
class EntryFileError : public ExecutorError {
 public:
  using ExecutorError::ExecutorError;
};

// `what` is a C string so that the success path, taken on every call, builds no std::string.
void CheckFrontend(cudnn_frontend::error_t status, const char* what) {
  if (status.is_bad()) {
    throw ExecutorError(std::string(what) + " failed: " + status.get_message());
  }
}

void CheckCudnn(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS) {
    throw ExecutorError(std::string(what) + " failed: " + fe_detail::get_error_string(status));
  }
}

void CheckCuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw ExecutorError(std::string(what) + " failed: " + fe_detail::cuda_get_error_string(status));
  }
}

// ===================================================================================================
// 2. cuDNN library
// ===================================================================================================
// Nothing CUDA is linked. cuDNN: the frontend reaches it through cudnn_dlhandle, which points at the
// libcudnn.so.9 JAX's CUDA plugin has already loaded (RTLD_NOLOAD finds it by soname), so the
// process keeps one cuDNN and one build of this library serves every cuDNN 9.x. The CUDA runtime,
// the driver and NVRTC the frontend dlopens itself, by soname: libcudart.so.12 or .13 (the copy
// JAX loaded; if both majors are loaded it warns and takes 12, and CUDNN_FRONTEND_CUDART_LIB_NAME
// picks one), libcuda.so.1, libnvrtc. The executor's own CUDA calls go through the same shims.

void BindCudnnLibrary() {
  static const std::string failure = [] {
    constexpr const char* kCudnnSoname = "libcudnn.so.9";
    void* library = dlopen(kCudnnSoname, RTLD_NOW | RTLD_NOLOAD);
    if (library == nullptr) {
      library = dlopen(kCudnnSoname, RTLD_NOW);
    }
    if (library == nullptr) {
      const char* reason = dlerror();
      return std::string("cannot load ") + kCudnnSoname + ": " + (reason ? reason : "unknown error") +
             " (JAX's CUDA plugin normally loads it: is jax installed with CUDA support?)";
    }
    cudnn_frontend::cudnn_dlhandle = library;
    return std::string();
  }();
  if (!failure.empty()) {
    throw ExecutorError(failure);
  }
}

// ===================================================================================================
// 3. Stream capture
// ===================================================================================================
// XLA records a command buffer by capturing the handler on its stream in thread-local mode, which
// makes this thread's cudaMalloc, stream creation and module loads fail. XLA runs one warm-up
// iteration outside capture first, so a graph is normally deserialized before; a capture that comes
// first (a user's CUDA graph, an XLA without warm-up) must still work. Creating a handle and
// deserializing a graph touch no captured stream, so they run under relaxed mode.

class RelaxedCaptureModeScope {
 public:
  RelaxedCaptureModeScope() {
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    if (fe_detail::cu_thread_exchange_stream_capture_mode(&mode) == CUDA_SUCCESS) {
      previous_mode_ = mode;
    }
  }

  ~RelaxedCaptureModeScope() {
    if (!previous_mode_) {
      return;
    }
    CUstreamCaptureMode mode = *previous_mode_;
    // The constructor already resolved the driver symbol, so this cannot fail to find it; a
    // destructor must not throw in any case.
    try {
      fe_detail::cu_thread_exchange_stream_capture_mode(&mode);
    } catch (const std::exception&) {
    }
  }

  RelaxedCaptureModeScope(const RelaxedCaptureModeScope&) = delete;
  RelaxedCaptureModeScope& operator=(const RelaxedCaptureModeScope&) = delete;

 private:
  std::optional<CUstreamCaptureMode> previous_mode_;
};

bool IsCapturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CheckCuda(fe_detail::cuda_stream_is_capturing(stream, &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

// ===================================================================================================
// 4. Cache entry files
// ===================================================================================================
// Layout (written by the Python disk cache):
//   8 bytes  magic "SDPAGRPH"
//   u32 LE   format version (1)
//   u32 LE   CRC-32 of the payload (zlib.crc32)
//   payload  one msgpack map with string keys, among them "key_hash" (str) and "blob" (bin)

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

// Verifies the entry at `path` and returns its serialized graph.
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

// ===================================================================================================
// 5. cuDNN handles
// ===================================================================================================

class CudnnHandle {
 public:
  // Binds the handle to the device current on this thread; XLA makes the call's device current.
  static std::unique_ptr<CudnnHandle> CreateForCurrentDevice() {
    cudnnHandle_t handle = nullptr;
    CheckCudnn(fe_detail::create_handle(&handle), "cudnnCreate");
    return std::make_unique<CudnnHandle>(handle);
  }

  explicit CudnnHandle(cudnnHandle_t handle) : handle_(handle) {}

  ~CudnnHandle() {
    try {
      fe_detail::destroy_handle(handle_);  // nothing useful to do with a failure here
    } catch (const std::exception&) {
    }
  }

  CudnnHandle(const CudnnHandle&) = delete;
  CudnnHandle& operator=(const CudnnHandle&) = delete;

  cudnnHandle_t get() const { return handle_; }

 private:
  cudnnHandle_t handle_;
};

// A thread's handle for one device and the stream it is bound to. cudnnSetStream costs about as much
// as the rest of the executor's own per-call work together, so a call on the stream the handle
// already has (XLA's, nearly always) skips it.
class ThreadHandle {
 public:
  explicit ThreadHandle(cudnnHandle_t handle) : handle_(handle) {}

  // Compares stream handles only: a stream destroyed and another created at the same address would
  // keep the old binding, which is harmless because cuDNN keeps nothing of a stream but its handle.
  cudnnHandle_t OnStream(cudaStream_t stream) {
    if (!stream_known_ || stream != stream_) {
      stream_known_ = false;  // stays unknown if cudnnSetStream throws
      CheckCudnn(fe_detail::set_stream(handle_, stream), "cudnnSetStream");
      stream_ = stream;
      stream_known_ = true;
    }
    return handle_;
  }

  // For code that may re-point the handle itself (the frontend's deserialize warmup does, and does
  // not restore the stream when it fails): the next OnStream sets the stream again.
  void ForgetStream() { stream_known_ = false; }

 private:
  cudnnHandle_t handle_;
  cudaStream_t stream_ = nullptr;
  bool stream_known_ = false;
};

// One handle per (device, thread): a handle belongs to the device it was created on, and
// cudnnSetStream followed by execute must not race with another thread re-pointing the same handle.
// The pool owns every handle for the life of the process (see ExecutorState); each thread keeps a
// non-owning index so the hot path takes no lock.
class HandlePool {
 public:
  ThreadHandle& ForCurrentThread(int device) {
    thread_local std::unordered_map<int, ThreadHandle> handles_of_this_thread;
    if (const auto found = handles_of_this_thread.find(device); found != handles_of_this_thread.end()) {
      return found->second;
    }
    std::unique_ptr<CudnnHandle> handle;
    {
      RelaxedCaptureModeScope relaxed;  // cudnnCreate allocates device memory
      handle = CudnnHandle::CreateForCurrentDevice();
    }
    const cudnnHandle_t raw_handle = handle->get();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      owned_.push_back(std::move(handle));
    }
    return handles_of_this_thread.emplace(device, ThreadHandle(raw_handle)).first->second;
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<CudnnHandle>> owned_;
};

// ===================================================================================================
// 6. Graph registry
// ===================================================================================================

// A graph deserialized for one device. Immutable once built; the frontend's execute() is const and
// safe to call from several threads with different handles.
struct DeviceGraph {
  cudnn_frontend::graph::Graph graph;
  std::vector<int64_t> variant_pack_uids;  // the tensors execute() takes pointers for, in its order
  int64_t workspace_size = 0;
};

std::unique_ptr<const DeviceGraph> Deserialize(const std::vector<uint8_t>& blob, ThreadHandle& thread_handle,
                                               cudaStream_t xla_stream) {
  RelaxedCaptureModeScope relaxed;
  // The frontend's warmup runs the plan once inside a throwaway capture so that its kernels are
  // loaded before anyone captures it for real; it synchronizes the device, which must not happen
  // while XLA is capturing, so a graph first met during capture loads its kernels on first launch.
  const bool warmup = !IsCapturing(xla_stream);
  // On the default stream, the warmup captures a private stream of its own, never XLA's.
  const cudnnHandle_t handle = thread_handle.OnStream(nullptr);
  thread_handle.ForgetStream();
  auto device_graph = std::make_unique<DeviceGraph>();
  CheckFrontend(device_graph->graph.deserialize(handle, blob, /*enforce_precompiled=*/true, warmup),
                "deserialize");
  device_graph->variant_pack_uids = device_graph->graph.get_variant_pack_uids_sorted();
  CheckFrontend(device_graph->graph.get_workspace_size(device_graph->workspace_size), "get_workspace_size");
  return device_graph;
}

class GraphEntry {
 public:
  explicit GraphEntry(std::vector<uint8_t> blob) : blob_(std::move(blob)) {}

  // Deserializes on the first call for `device` and returns the same graph afterwards. The device's
  // mutex is held while deserializing, so each device deserializes at most once; a failure leaves
  // the slot empty and the next call tries again.
  const DeviceGraph& ForDevice(int device, ThreadHandle& handle, cudaStream_t xla_stream,
                               std::atomic<int64_t>& deserialize_count) {
    DeviceSlot& slot = SlotFor(device);
    std::lock_guard<std::mutex> lock(slot.mutex);
    if (!slot.graph) {
      slot.graph = Deserialize(blob_, handle, xla_stream);
      deserialize_count.fetch_add(1, std::memory_order_relaxed);
    }
    return *slot.graph;
  }

 private:
  struct DeviceSlot {
    std::mutex mutex;
    std::unique_ptr<const DeviceGraph> graph;
  };

  DeviceSlot& SlotFor(int device) {
    std::lock_guard<std::mutex> lock(slots_mutex_);
    std::unique_ptr<DeviceSlot>& slot = slots_[device];
    if (!slot) {
      slot = std::make_unique<DeviceSlot>();
    }
    return *slot;
  }

  const std::vector<uint8_t> blob_;
  std::mutex slots_mutex_;
  std::unordered_map<int, std::unique_ptr<DeviceSlot>> slots_;  // slots are never removed
};

class GraphRegistry {
 public:
  std::shared_ptr<GraphEntry> Find(const std::string& key) const {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    const auto found = entries_.find(key);
    return found == entries_.end() ? nullptr : found->second;
  }

  // Keeps the first blob registered under a key: a key names one graph configuration, and any blob
  // built for it serves, so registering again is a no-op.
  std::shared_ptr<GraphEntry> Insert(const std::string& key, std::vector<uint8_t> blob) {
    auto entry = std::make_shared<GraphEntry>(std::move(blob));
    std::unique_lock<std::shared_mutex> lock(mutex_);
    return entries_.emplace(key, std::move(entry)).first->second;
  }

 private:
  mutable std::shared_mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<GraphEntry>> entries_;
};

// Where the handler's host time goes, for bench/attention.py: the whole handler, and the part of it
// inside the frontend's execute (cuDNN's own per-call work, kernel launch included). Counted only
// while enabled, so an untimed call pays one relaxed load. Meant for a quiet moment between calls:
// a call still running when the totals are taken is counted in the next window.
class HostTiming {
 public:
  struct Totals {
    bool was_enabled = false;  // whether timing was on during the window these totals cover
    int64_t calls = 0;
    int64_t handler_ns = 0;
    int64_t cudnn_execute_ns = 0;
  };

  static int64_t NowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  void Add(int64_t handler_ns, int64_t cudnn_execute_ns) {
    calls_.fetch_add(1, std::memory_order_relaxed);
    handler_ns_.fetch_add(handler_ns, std::memory_order_relaxed);
    cudnn_execute_ns_.fetch_add(cudnn_execute_ns, std::memory_order_relaxed);
  }

  // Returns the totals so far, resets them, and turns counting on or off.
  Totals Take(bool enable) {
    Totals totals;
    totals.was_enabled = enabled_.exchange(enable, std::memory_order_relaxed);
    totals.calls = calls_.exchange(0, std::memory_order_relaxed);
    totals.handler_ns = handler_ns_.exchange(0, std::memory_order_relaxed);
    totals.cudnn_execute_ns = cudnn_execute_ns_.exchange(0, std::memory_order_relaxed);
    return totals;
  }

 private:
  std::atomic<bool> enabled_{false};
  std::atomic<int64_t> calls_{0};
  std::atomic<int64_t> handler_ns_{0};
  std::atomic<int64_t> cudnn_execute_ns_{0};
};

struct ExecutorState {
  // Members are destroyed in reverse order: the graphs (built and executed with these handles) go
  // before the handles they need.
  HandlePool handles;
  GraphRegistry graphs;
  std::atomic<int64_t> deserialize_count{0};
  HostTiming timing;
};

// Never destroyed: a static destructor would run cudnnDestroy and the frontend's plan destructors at
// process exit, after JAX may have torn down the CUDA context, which can crash the exiting
// interpreter. The operating system reclaims everything instead (the frontend leaks its own loader
// state for the same reason).
ExecutorState& State() {
  static ExecutorState* const state = std::make_unique<ExecutorState>().release();
  return *state;
}

bool IsGraphKey(std::string_view key) {
  constexpr size_t kSha256HexDigits = 64;
  if (key.size() != kSha256HexDigits) return false;
  for (const char c : key) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::shared_ptr<GraphEntry> FindOrLoadGraph(const std::string& key, std::string_view entry_path) {
  if (std::shared_ptr<GraphEntry> entry = State().graphs.Find(key)) {
    return entry;
  }
  const std::string not_loaded = "graph " + key + " not loaded in this process and ";
  if (entry_path.empty()) {
    throw ExecutorError(not_loaded + "no cache entry path was given");
  }
  const std::string path(entry_path);
  try {
    return State().graphs.Insert(key, ReadEntryBlob(path, key));
  } catch (const EntryFileError& error) {
    throw ExecutorError(not_loaded + path + ": " + error.what());
  }
}

// ===================================================================================================
// 7. Execute handler
// ===================================================================================================

struct TensorPointer {
  int64_t uid;
  void* pointer;
};

// The `scalar_values` attribute: the 4-byte host value of each pass-by-value scalar, as a float32
// array, or as an int32 array (an int32 scalar, or any scalar's bit pattern). cuDNN reads each
// value as its tensor's data type, so the executor only hands out pointers into this storage.
struct HostScalars {
  const uint32_t* words;
  size_t count;
};

}  // namespace
}  // namespace sdpagraph

template <>
struct xla::ffi::AttrDecoding<sdpagraph::HostScalars> {
  using Type = sdpagraph::HostScalars;

  static bool Isa(XLA_FFI_AttrType type, void* attr) {
    if (type != XLA_FFI_AttrType_ARRAY) return false;
    const XLA_FFI_DataType dtype = static_cast<XLA_FFI_Array*>(attr)->dtype;
    return dtype == XLA_FFI_DataType_F32 || dtype == XLA_FFI_DataType_S32;
  }

  static std::optional<Type> Decode(XLA_FFI_AttrType type, void* attr, DiagnosticEngine& diagnostic) {
    if (!Isa(type, attr)) {
      return diagnostic.Emit("scalar_values must be a float32 or int32 array");
    }
    const auto* array = static_cast<XLA_FFI_Array*>(attr);
    return Type{static_cast<const uint32_t*>(array->data), array->size};
  }
};

namespace sdpagraph {
namespace {

// Orders the call's pointers the way the graph's execute() takes them, and rejects a call that
// misses a tensor of the graph, names one twice, or names one the graph does not have.
std::vector<void*> VariantPack(const std::vector<TensorPointer>& given, const std::vector<int64_t>& needed) {
  for (size_t i = 0; i < given.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (given[j].uid == given[i].uid) {
        throw InvalidCallError("uid " + std::to_string(given[i].uid) + " is given twice");
      }
    }
  }
  std::vector<void*> pointers;
  pointers.reserve(needed.size());
  for (const int64_t uid : needed) {
    const TensorPointer* match = nullptr;
    for (const TensorPointer& candidate : given) {
      if (candidate.uid == uid) match = &candidate;
    }
    if (match == nullptr) {
      throw InvalidCallError("the graph needs uid " + std::to_string(uid) +
                             ", which is not among the operands, results or scalars");
    }
    pointers.push_back(match->pointer);
  }
  if (given.size() != needed.size()) {
    for (const TensorPointer& candidate : given) {
      bool is_needed = false;
      for (const int64_t uid : needed) is_needed = is_needed || uid == candidate.uid;
      if (!is_needed) {
        throw InvalidCallError("uid " + std::to_string(candidate.uid) + " is not a tensor of this graph");
      }
    }
  }
  return pointers;
}

void* OperandData(const ffi::RemainingArgs& operands, size_t index) {
  ffi::ErrorOr<ffi::AnyBuffer> buffer = operands.get<ffi::AnyBuffer>(index);
  if (!buffer.has_value()) {
    throw InvalidCallError("operand " + std::to_string(index) + ": " + buffer.error().message());
  }
  return buffer->untyped_data();
}

ffi::AnyBuffer ResultBuffer(const ffi::RemainingRets& results, size_t index) {
  ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> buffer = results.get<ffi::AnyBuffer>(index);
  if (!buffer.has_value()) {
    throw InvalidCallError("result " + std::to_string(index) + ": " + buffer.error().message());
  }
  return **buffer;
}

// Returns the nanoseconds spent in the frontend's execute when `timed`, else 0.
int64_t RunGraph(cudaStream_t stream, int32_t device, const ffi::RemainingArgs& operands,
                 const ffi::RemainingRets& results, const std::string& key, std::string_view entry_path,
                 ffi::Span<const int64_t> uids, ffi::Span<const int64_t> scalar_uids, HostScalars scalar_values,
                 int64_t workspace_size, bool timed) {
  if (results.size() == 0) {
    throw InvalidCallError("the workspace must be passed as the last result");
  }
  const size_t tensor_results = results.size() - 1;
  if (uids.size() != operands.size() + tensor_results) {
    throw InvalidCallError(std::to_string(uids.size()) + " uids for " + std::to_string(operands.size()) +
                           " operands and " + std::to_string(tensor_results) +
                           " results (the workspace, the last result, has no uid)");
  }
  if (scalar_uids.size() != scalar_values.count) {
    throw InvalidCallError(std::to_string(scalar_uids.size()) + " scalar_uids for " +
                           std::to_string(scalar_values.count) + " scalar_values");
  }

  BindCudnnLibrary();
  const std::shared_ptr<GraphEntry> entry = FindOrLoadGraph(key, entry_path);
  ThreadHandle& thread_handle = State().handles.ForCurrentThread(device);
  const DeviceGraph& graph = entry->ForDevice(device, thread_handle, stream, State().deserialize_count);

  const ffi::AnyBuffer workspace = ResultBuffer(results, tensor_results);
  if (workspace_size < graph.workspace_size) {
    throw InvalidCallError("workspace_size is " + std::to_string(workspace_size) + " but the graph needs " +
                           std::to_string(graph.workspace_size) + " bytes");
  }
  if (workspace.size_bytes() < static_cast<size_t>(graph.workspace_size)) {
    throw InvalidCallError("the workspace result has " + std::to_string(workspace.size_bytes()) +
                           " bytes but the graph needs " + std::to_string(graph.workspace_size));
  }

  std::vector<TensorPointer> given;
  given.reserve(uids.size() + scalar_uids.size());
  for (size_t i = 0; i < operands.size(); ++i) {
    given.push_back({uids[i], OperandData(operands, i)});
  }
  for (size_t i = 0; i < tensor_results; ++i) {
    given.push_back({uids[operands.size() + i], ResultBuffer(results, i).untyped_data()});
  }
  for (size_t i = 0; i < scalar_uids.size(); ++i) {
    // cuDNN reads pass-by-value scalars from host memory when the plan is launched; the attribute
    // storage outlives the call.
    given.push_back({scalar_uids[i], const_cast<uint32_t*>(scalar_values.words + i)});
  }
  std::vector<void*> pointers = VariantPack(given, graph.variant_pack_uids);

  const cudnnHandle_t handle = thread_handle.OnStream(stream);
  const int64_t execute_start = timed ? HostTiming::NowNs() : 0;
  CheckFrontend(graph.graph.execute(handle, pointers.data(), static_cast<int>(pointers.size()),
                                    workspace.untyped_data()),
                "execute");
  return timed ? HostTiming::NowNs() - execute_start : 0;
}

ffi::Error ExecuteGraph(cudaStream_t stream, int32_t device, ffi::RemainingArgs operands,
                        ffi::RemainingRets results, std::string_view graph_key, std::string_view entry_path,
                        ffi::Span<const int64_t> uids, ffi::Span<const int64_t> scalar_uids,
                        HostScalars scalar_values, int64_t workspace_size) {
  HostTiming& timing = State().timing;
  const bool timed = timing.enabled();
  const int64_t start = timed ? HostTiming::NowNs() : 0;
  const std::string key(graph_key);
  try {
    const int64_t cudnn_execute_ns = RunGraph(stream, device, operands, results, key, entry_path, uids,
                                              scalar_uids, scalar_values, workspace_size, timed);
    if (timed) timing.Add(HostTiming::NowNs() - start, cudnn_execute_ns);
    return ffi::Error::Success();
  } catch (const InvalidCallError& error) {
    return ffi::Error::InvalidArgument("sdpagraph_execute, graph " + key + ": " + error.what());
  } catch (const std::exception& error) {
    return ffi::Error::Internal("sdpagraph_execute, graph " + key + ": " + error.what());
  } catch (...) {
    return ffi::Error::Internal("sdpagraph_execute, graph " + key + ": unknown exception");
  }
}

// Status codes of the C entry points; loader.py maps them to messages.
enum EntryPointStatus : int {
  kStatusOk = 0,
  kStatusInvalidKey = 1,    // not a 64-digit lowercase hex digest
  kStatusEmptyBlob = 2,     // null or empty blob
  kStatusEntryInvalid = 3,  // the cache entry file cannot be used (reason in the error buffer)
  kStatusInternal = 4,      // out of memory or another unexpected failure
};

auto ExecuteBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .RemainingArgs()
      .RemainingRets()
      .Attr<std::string_view>("graph_key")
      .Attr<std::string_view>("entry_path")
      .Attr<ffi::Span<const int64_t>>("uids")
      .Attr<ffi::Span<const int64_t>>("scalar_uids")
      .Attr<HostScalars>("scalar_values")
      .Attr<int64_t>("workspace_size");
}

// ===================================================================================================
// 8. Direct runs
// ===================================================================================================
// The numerical check (sdpagraph/ffi/direct.py) runs a freshly built graph once on random inputs.
// Compiling an XLA program around one FFI call took longer than building the graph, so the check
// runs the graph here instead: on device memory it allocates through the entry points below, on a
// stream of its own, synchronously. Nothing here is on XLA's path.

// Makes `device` current on the calling thread (the check runs on a worker thread of its own).
void UseDevice(int device) {
  using SetDevice = cudaError_t (*)(int);
  const auto set_device =
      reinterpret_cast<SetDevice>(fe_detail::get_cuda_symbol(fe_detail::CudaLibrary::CUDART, "cudaSetDevice"));
  CheckCuda(set_device(device), "cudaSetDevice");
}

class OwnedStream {
 public:
  OwnedStream() { CheckCuda(fe_detail::cuda_stream_create(&stream_), "cudaStreamCreate"); }

  ~OwnedStream() {
    try {
      fe_detail::cuda_stream_synchronize(stream_);  // nothing may still run on a destroyed stream
      fe_detail::cuda_stream_destroy(stream_);
    } catch (const std::exception&) {
    }
  }

  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;

  cudaStream_t get() const { return stream_; }
  void Synchronize() const { CheckCuda(fe_detail::cuda_stream_synchronize(stream_), "cudaStreamSynchronize"); }

 private:
  cudaStream_t stream_ = nullptr;
};

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    if (bytes > 0) CheckCuda(fe_detail::cuda_malloc(&pointer_, bytes), "cudaMalloc");
  }

  ~DeviceBuffer() {
    try {
      if (pointer_ != nullptr) fe_detail::cuda_free(pointer_);
    } catch (const std::exception&) {
    }
  }

  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return pointer_; }

  // Hands the memory to the caller (sdpagraph_device_free frees it), once it is ready.
  void* Release() { return std::exchange(pointer_, nullptr); }

 private:
  void* pointer_ = nullptr;
};

// Makes `count` copies of one kind (host to device, device to host, or within the device) on one
// stream and waits for them all: the check copies hundreds of small blocks, and a stream and a wait
// per block would cost more than the bytes.
void CopyAllSync(size_t count, void* const* destinations, const void* const* sources, const size_t* bytes,
                 cudaMemcpyKind kind) {
  OwnedStream stream;
  for (size_t i = 0; i < count; ++i) {
    if (bytes[i] == 0) continue;
    CheckCuda(fe_detail::cuda_mem_cpy_async(destinations[i], sources[i], bytes[i], kind, stream.get()),
              "cudaMemcpyAsync");
  }
  stream.Synchronize();
}

// Runs the registered graph `key` on `given` (every tensor's uid and device pointer, scalars'
// host pointers) with a workspace of its own, and waits for it.
void RunDirect(const std::string& key, int device, const std::vector<TensorPointer>& given) {
  BindCudnnLibrary();
  UseDevice(device);
  const std::shared_ptr<GraphEntry> entry = FindOrLoadGraph(key, "");
  OwnedStream stream;
  ThreadHandle& thread_handle = State().handles.ForCurrentThread(device);
  const DeviceGraph& graph = entry->ForDevice(device, thread_handle, stream.get(), State().deserialize_count);
  std::vector<void*> pointers = VariantPack(given, graph.variant_pack_uids);
  DeviceBuffer workspace(static_cast<size_t>(graph.workspace_size));
  CheckFrontend(graph.graph.execute(thread_handle.OnStream(stream.get()), pointers.data(),
                                    static_cast<int>(pointers.size()), workspace.get()),
                "execute");
  stream.Synchronize();
}

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

// ===================================================================================================
// 9. C entry points
// ===================================================================================================
// None of them lets an exception out: each catches and answers with a status code.

SDPAGRAPH_EXPORT XLA_FFI_Error* sdpagraph_execute(XLA_FFI_CallFrame* call_frame);

#if SDPAGRAPH_COMMAND_BUFFER_COMPATIBLE
XLA_FFI_DEFINE_HANDLER_SYMBOL(sdpagraph_execute, sdpagraph::ExecuteGraph, sdpagraph::ExecuteBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
#else
XLA_FFI_DEFINE_HANDLER_SYMBOL(sdpagraph_execute, sdpagraph::ExecuteGraph, sdpagraph::ExecuteBinding());
#endif

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

// Direct runs (section 8): device memory for the numerical check, copies, and one synchronous run.
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
