// Graph registry: key -> serialized blob -> one deserialized graph per device, and the process-wide
// executor state that holds it.
#ifndef SDPAGRAPH_FFI_CSRC_GRAPH_REGISTRY_H_
#define SDPAGRAPH_FFI_CSRC_GRAPH_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cudnn_library.h"
#include "handles.h"
#include "host_timing.h"

namespace sdpagraph {

// A graph deserialized for one device. Immutable once built; the frontend's execute() is const and
// safe to call from several threads with different handles.
struct DeviceGraph {
  cudnn_frontend::graph::Graph graph;
  std::vector<int64_t> variant_pack_uids;  // the tensors execute() takes pointers for, in its order
  int64_t workspace_size = 0;
};

class GraphEntry {
 public:
  explicit GraphEntry(std::vector<uint8_t> blob) : blob_(std::move(blob)) {}

  // Deserializes on the first call for `device` and returns the same graph afterwards. The device's
  // mutex is held while deserializing, so each device deserializes at most once; a failure leaves
  // the slot empty and the next call tries again. The deserialization warms the plan up (loads its
  // kernels with a throwaway run, which synchronizes the device) unless `xla_stream` is capturing
  // or `warmup_allowed` is false; the kernels then load on the first launch.
  const DeviceGraph& ForDevice(int device, ThreadHandle& handle, cudaStream_t xla_stream,
                               std::atomic<int64_t>& deserialize_count, bool warmup_allowed = true);

 private:
  struct DeviceSlot {
    std::mutex mutex;
    std::unique_ptr<const DeviceGraph> graph;
  };

  DeviceSlot& SlotFor(int device);

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

struct ExecutorState {
  // Members are destroyed in reverse order: the graphs (built and executed with these handles) go
  // before the handles they need.
  HandlePool handles;
  GraphRegistry graphs;
  std::atomic<int64_t> deserialize_count{0};
  HostTiming timing;
};

// The process's one ExecutorState, created on first use and never destroyed (graph_registry.cc says
// why).
ExecutorState& State();

// Whether `key` is a 64-digit lowercase hex digest (a sha256), the form of every graph key.
bool IsGraphKey(std::string_view key);

// The registered graph `key`, or, on a registry miss, the one in the cache entry file at
// `entry_path` (verified and then registered). Throws ExecutorError naming the key when neither.
std::shared_ptr<GraphEntry> FindOrLoadGraph(const std::string& key, std::string_view entry_path);

}  // namespace sdpagraph

#endif  // SDPAGRAPH_FFI_CSRC_GRAPH_REGISTRY_H_
