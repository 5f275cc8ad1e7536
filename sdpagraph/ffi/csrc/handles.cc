// cuDNN handles: the per-thread index into the process-wide pool.
#include "handles.h"

#include <unordered_map>
#include <utility>

#include "stream_capture.h"

namespace sdpagraph {

ThreadHandle& HandlePool::ForCurrentThread(int device) {
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

}  // namespace sdpagraph
