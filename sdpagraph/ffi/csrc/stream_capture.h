// Stream capture: keeping one-time setup legal while XLA records a command buffer.
//
// XLA records a command buffer by capturing the handler on its stream in thread-local mode, which
// makes this thread's cudaMalloc, stream creation and module loads fail. XLA runs one warm-up
// iteration outside capture first, so a graph is normally deserialized before; a capture that comes
// first (a user's CUDA graph, an XLA without warm-up) must still work. Creating a handle and
// deserializing a graph touch no captured stream, so they run under relaxed mode.
#ifndef SDPAGRAPH_FFI_CSRC_STREAM_CAPTURE_H_
#define SDPAGRAPH_FFI_CSRC_STREAM_CAPTURE_H_

#include <optional>

#include "cudnn_library.h"

namespace sdpagraph {

// Switches this thread's capture mode to relaxed for the scope's life (when the driver allows it),
// then restores the previous mode.
class RelaxedCaptureModeScope {
 public:
  RelaxedCaptureModeScope();
  ~RelaxedCaptureModeScope();

  RelaxedCaptureModeScope(const RelaxedCaptureModeScope&) = delete;
  RelaxedCaptureModeScope& operator=(const RelaxedCaptureModeScope&) = delete;

 private:
  std::optional<CUstreamCaptureMode> previous_mode_;
};

// Whether `stream` is being captured.
bool IsCapturing(cudaStream_t stream);

}  // namespace sdpagraph

#endif  // SDPAGRAPH_FFI_CSRC_STREAM_CAPTURE_H_
