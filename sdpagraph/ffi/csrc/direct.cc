// Direct runs (direct.h says what they are for): setting the device, batched copies, and one
// synchronous run of a registered graph.
#include "direct.h"

#include <memory>

#include "graph_registry.h"
#include "handles.h"

namespace sdpagraph {

void UseDevice(int device) {
  using SetDevice = cudaError_t (*)(int);
  const auto set_device =
      reinterpret_cast<SetDevice>(fe_detail::get_cuda_symbol(fe_detail::CudaLibrary::CUDART, "cudaSetDevice"));
  CheckCuda(set_device(device), "cudaSetDevice");
}

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

namespace {

// A registered graph's entry and this thread's cuDNN handle, with `device` made current (so that
// streams made next belong to it).
struct DirectEntry {
  std::shared_ptr<GraphEntry> entry;
  ThreadHandle& thread_handle;
};

DirectEntry EntryOnDevice(const std::string& key, int device) {
  BindCudnnLibrary();
  UseDevice(device);
  return {FindOrLoadGraph(key, ""), State().handles.ForCurrentThread(device)};
}

}  // namespace

void RunDirect(const std::string& key, int device, const std::vector<TensorPointer>& given) {
  const DirectEntry direct = EntryOnDevice(key, device);
  OwnedStream stream;
  const DeviceGraph& graph =
      direct.entry->ForDevice(device, direct.thread_handle, stream.get(), State().deserialize_count);
  std::vector<void*> pointers = VariantPack(given, graph.variant_pack_uids);
  DeviceBuffer workspace(static_cast<size_t>(graph.workspace_size));
  CheckFrontend(graph.graph.execute(direct.thread_handle.OnStream(stream.get()), pointers.data(),
                                    static_cast<int>(pointers.size()), workspace.get()),
                "execute");
  stream.Synchronize();
}

void PrepareDirect(const std::string& key, int device) {
  const DirectEntry direct = EntryOnDevice(key, device);
  direct.entry->ForDevice(device, direct.thread_handle, /*xla_stream=*/nullptr, State().deserialize_count,
                          /*warmup_allowed=*/false);
}

}  // namespace sdpagraph
