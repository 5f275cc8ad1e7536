// Direct runs: a graph run once outside XLA, for the numerical check.
//
// The numerical check (sdpagraph/ffi/direct.py) runs a freshly built graph once on random inputs.
// Compiling an XLA program around one FFI call took longer than building the graph, so the check
// runs the graph here instead: on device memory it allocates through the entry points
// (entry_points.cc), on a stream of its own, synchronously. Nothing here is on XLA's path.
#ifndef SDPAGRAPH_FFI_CSRC_DIRECT_H_
#define SDPAGRAPH_FFI_CSRC_DIRECT_H_

#include <cstddef>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "cudnn_library.h"
#include "variant_pack.h"

namespace sdpagraph {

// Makes `device` current on the calling thread (the check runs on a worker thread of its own).
void UseDevice(int device);

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
                 cudaMemcpyKind kind);

// Runs the registered graph `key` on `given` (every tensor's uid and device pointer, scalars'
// host pointers) with a workspace of its own, and waits for it.
void RunDirect(const std::string& key, int device, const std::vector<TensorPointer>& given);

// Deserializes the registered graph `key` for `device` ahead of its first call, which then finds it
// ready. No warmup run: that synchronizes the device, which would break a command buffer XLA may be
// recording on another thread; the plan's kernels load on its first launch instead. A call that
// needs the graph meanwhile waits for this deserialization (GraphEntry::ForDevice).
void PrepareDirect(const std::string& key, int device);

}  // namespace sdpagraph

#endif  // SDPAGRAPH_FFI_CSRC_DIRECT_H_
