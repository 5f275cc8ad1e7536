// Errors: how failures travel to the handler boundary.
//
// Failures are thrown inside the executor and turned into ffi::Error at the handler boundary (or a
// status code at the C entry points), because the frontend itself throws: std::runtime_error for a
// missing cuDNN or CUDA symbol, nlohmann::json exceptions for a malformed blob. The checks that turn
// a cuDNN, CUDA or frontend status into an ExecutorError are in cudnn_library.h.
#ifndef SDPAGRAPH_FFI_CSRC_ERRORS_H_
#define SDPAGRAPH_FFI_CSRC_ERRORS_H_

#include <stdexcept>

namespace sdpagraph {

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

}  // namespace sdpagraph

#endif  // SDPAGRAPH_FFI_CSRC_ERRORS_H_
