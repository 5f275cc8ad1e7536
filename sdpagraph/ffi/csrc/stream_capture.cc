// Stream capture: relaxed capture mode for one-time setup (stream_capture.h says why).
#include "stream_capture.h"

#include <exception>

namespace sdpagraph {

RelaxedCaptureModeScope::RelaxedCaptureModeScope() {
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  if (fe_detail::cu_thread_exchange_stream_capture_mode(&mode) == CUDA_SUCCESS) {
    previous_mode_ = mode;
  }
}

RelaxedCaptureModeScope::~RelaxedCaptureModeScope() {
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

bool IsCapturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CheckCuda(fe_detail::cuda_stream_is_capturing(stream, &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace sdpagraph
