// Graph registry: deserializing a graph once per device, the executor state, and loading a graph
// from its cache entry file on a registry miss.
#include "graph_registry.h"

#include "entry_file.h"
#include "errors.h"
#include "stream_capture.h"

namespace sdpagraph {
namespace {

std::unique_ptr<const DeviceGraph> Deserialize(const std::vector<uint8_t>& blob, ThreadHandle& thread_handle,
                                               cudaStream_t xla_stream, bool warmup_allowed) {
  RelaxedCaptureModeScope relaxed;
  // The frontend's warmup runs the plan once inside a throwaway capture so that its kernels are
  // loaded before anyone captures it for real; it synchronizes the device, which must not happen
  // while XLA is capturing, so a graph first met during capture loads its kernels on first launch.
  const bool warmup = warmup_allowed && !IsCapturing(xla_stream);
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

}  // namespace

const DeviceGraph& GraphEntry::ForDevice(int device, ThreadHandle& handle, cudaStream_t xla_stream,
                                         std::atomic<int64_t>& deserialize_count, bool warmup_allowed) {
  DeviceSlot& slot = SlotFor(device);
  std::lock_guard<std::mutex> lock(slot.mutex);
  if (!slot.graph) {
    slot.graph = Deserialize(blob_, handle, xla_stream, warmup_allowed);
    deserialize_count.fetch_add(1, std::memory_order_relaxed);
  }
  return *slot.graph;
}

GraphEntry::DeviceSlot& GraphEntry::SlotFor(int device) {
  std::lock_guard<std::mutex> lock(slots_mutex_);
  std::unique_ptr<DeviceSlot>& slot = slots_[device];
  if (!slot) {
    slot = std::make_unique<DeviceSlot>();
  }
  return *slot;
}

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

}  // namespace sdpagraph
