// cuDNN library: the frontend's headers, binding the frontend to the libcudnn JAX already loaded
// (cudnn_library.cc says how), and the checks that turn a cuDNN, CUDA or frontend status into an
// ExecutorError. Every file that calls cuDNN or CUDA includes this header.
#ifndef SDPAGRAPH_FFI_CSRC_CUDNN_LIBRARY_H_
#define SDPAGRAPH_FFI_CSRC_CUDNN_LIBRARY_H_

#include <string>

#include "cudnn_frontend.h"
#include "errors.h"

namespace sdpagraph {

namespace fe_detail = cudnn_frontend::detail;

// Points the frontend at libcudnn.so.9, once per process; throws ExecutorError with the reason on
// every call when that failed.
void BindCudnnLibrary();

// `what` is a C string so that the success path, taken on every call, builds no std::string.
inline void CheckFrontend(cudnn_frontend::error_t status, const char* what) {
  if (status.is_bad()) {
    throw ExecutorError(std::string(what) + " failed: " + status.get_message());
  }
}

inline void CheckCudnn(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS) {
    throw ExecutorError(std::string(what) + " failed: " + fe_detail::get_error_string(status));
  }
}

inline void CheckCuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw ExecutorError(std::string(what) + " failed: " + fe_detail::cuda_get_error_string(status));
  }
}

}  // namespace sdpagraph

#endif  // SDPAGRAPH_FFI_CSRC_CUDNN_LIBRARY_H_
