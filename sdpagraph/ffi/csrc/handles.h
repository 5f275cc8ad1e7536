// cuDNN handles: one per (device, thread), for the life of the process.
#ifndef SDPAGRAPH_FFI_CSRC_HANDLES_H_
#define SDPAGRAPH_FFI_CSRC_HANDLES_H_

#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include "cudnn_library.h"

namespace sdpagraph {

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
  ThreadHandle& ForCurrentThread(int device);

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<CudnnHandle>> owned_;
};

}  // namespace sdpagraph

#endif  // SDPAGRAPH_FFI_CSRC_HANDLES_H_
