// Execute handler: the XLA FFI handler `sdpagraph_execute`, which runs a graph on XLA's stream with
// XLA's workspace. loader.py documents its call contract for the Python side.
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cudnn_library.h"
#include "entry_points.h"
#include "errors.h"
#include "graph_registry.h"
#include "handles.h"
#include "host_timing.h"
#include "variant_pack.h"
#include "xla/ffi/api/ffi.h"

namespace sdpagraph {
namespace {

namespace ffi = xla::ffi;

// The `scalar_values` attribute: the 4-byte host value of each pass-by-value scalar, as a float32
// array, or as an int32 array (an int32 scalar, or any scalar's bit pattern). cuDNN reads each
// value as its tensor's data type, so the executor only hands out pointers into this storage.
struct HostScalars {
  const uint32_t* words;
  size_t count;
};

}  // namespace
}  // namespace sdpagraph

template <>
struct xla::ffi::AttrDecoding<sdpagraph::HostScalars> {
  using Type = sdpagraph::HostScalars;

  static bool Isa(XLA_FFI_AttrType type, void* attr) {
    if (type != XLA_FFI_AttrType_ARRAY) return false;
    const XLA_FFI_DataType dtype = static_cast<XLA_FFI_Array*>(attr)->dtype;
    return dtype == XLA_FFI_DataType_F32 || dtype == XLA_FFI_DataType_S32;
  }

  static std::optional<Type> Decode(XLA_FFI_AttrType type, void* attr, DiagnosticEngine& diagnostic) {
    if (!Isa(type, attr)) {
      return diagnostic.Emit("scalar_values must be a float32 or int32 array");
    }
    const auto* array = static_cast<XLA_FFI_Array*>(attr);
    return Type{static_cast<const uint32_t*>(array->data), array->size};
  }
};

namespace sdpagraph {
namespace {

void* OperandData(const ffi::RemainingArgs& operands, size_t index) {
  ffi::ErrorOr<ffi::AnyBuffer> buffer = operands.get<ffi::AnyBuffer>(index);
  if (!buffer.has_value()) {
    throw InvalidCallError("operand " + std::to_string(index) + ": " + buffer.error().message());
  }
  return buffer->untyped_data();
}

ffi::AnyBuffer ResultBuffer(const ffi::RemainingRets& results, size_t index) {
  ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> buffer = results.get<ffi::AnyBuffer>(index);
  if (!buffer.has_value()) {
    throw InvalidCallError("result " + std::to_string(index) + ": " + buffer.error().message());
  }
  return **buffer;
}

// How the graph's output tensors lie in the call's results: result i holds `parts[i]` of them, equal
// in size and one after another (dK and dV stacked into one array, which then travels as one
// transfer without a copy), and is zeroed before the graph runs where `zeroed[i]` is nonzero (a
// packed graph writes only the rows of its sequences).
struct ResultLayout {
  ffi::Span<const int64_t> parts;
  ffi::Span<const int64_t> zeroed;
};

// The number of graph tensors the results hold (at most `max_tensors`: the uids left after the
// operands'); rejects a layout that does not fit the results.
size_t CheckedResultTensors(const ResultLayout& layout, size_t tensor_results, size_t max_tensors) {
  if (layout.parts.size() != tensor_results || layout.zeroed.size() != tensor_results) {
    throw InvalidCallError(std::to_string(layout.parts.size()) + " result_parts and " +
                           std::to_string(layout.zeroed.size()) + " zeroed_results for " +
                           std::to_string(tensor_results) + " results (one each, the workspace excepted)");
  }
  size_t tensors = 0;
  for (const int64_t parts : layout.parts) {
    if (parts < 1 || static_cast<uint64_t>(parts) > max_tensors - tensors) {
      throw InvalidCallError("result_parts " + std::to_string(parts) + " is not between 1 and the " +
                             std::to_string(max_tensors - tensors) + " uids left for it");
    }
    tensors += static_cast<size_t>(parts);
  }
  return tensors;
}

// Returns the nanoseconds spent in the frontend's execute when `timed`, else 0.
int64_t RunGraph(cudaStream_t stream, int32_t device, const ffi::RemainingArgs& operands,
                 const ffi::RemainingRets& results, const std::string& key, std::string_view entry_path,
                 ffi::Span<const int64_t> uids, const ResultLayout& layout, ffi::Span<const int64_t> scalar_uids,
                 HostScalars scalar_values, int64_t workspace_size, bool timed) {
  if (results.size() == 0) {
    throw InvalidCallError("the workspace must be passed as the last result");
  }
  const size_t tensor_results = results.size() - 1;
  if (uids.size() < operands.size()) {
    throw InvalidCallError(std::to_string(uids.size()) + " uids for " + std::to_string(operands.size()) + " operands");
  }
  const size_t result_tensors = CheckedResultTensors(layout, tensor_results, uids.size() - operands.size());
  if (uids.size() != operands.size() + result_tensors) {
    throw InvalidCallError(std::to_string(uids.size()) + " uids for " + std::to_string(operands.size()) +
                           " operands and " + std::to_string(result_tensors) +
                           " tensors in the results (the workspace, the last result, has no uid)");
  }
  if (scalar_uids.size() != scalar_values.count) {
    throw InvalidCallError(std::to_string(scalar_uids.size()) + " scalar_uids for " +
                           std::to_string(scalar_values.count) + " scalar_values");
  }

  BindCudnnLibrary();
  const std::shared_ptr<GraphEntry> entry = FindOrLoadGraph(key, entry_path);
  ThreadHandle& thread_handle = State().handles.ForCurrentThread(device);
  const DeviceGraph& graph = entry->ForDevice(device, thread_handle, stream, State().deserialize_count);

  const ffi::AnyBuffer workspace = ResultBuffer(results, tensor_results);
  if (workspace_size < graph.workspace_size) {
    throw InvalidCallError("workspace_size is " + std::to_string(workspace_size) + " but the graph needs " +
                           std::to_string(graph.workspace_size) + " bytes");
  }
  if (workspace.size_bytes() < static_cast<size_t>(graph.workspace_size)) {
    throw InvalidCallError("the workspace result has " + std::to_string(workspace.size_bytes()) +
                           " bytes but the graph needs " + std::to_string(graph.workspace_size));
  }

  std::vector<TensorPointer> given;
  given.reserve(uids.size() + scalar_uids.size());
  for (size_t i = 0; i < operands.size(); ++i) {
    given.push_back({uids[i], OperandData(operands, i)});
  }
  std::vector<ffi::AnyBuffer> to_zero;
  size_t next_uid = operands.size();
  for (size_t i = 0; i < tensor_results; ++i) {
    const ffi::AnyBuffer result = ResultBuffer(results, i);
    const size_t parts = static_cast<size_t>(layout.parts[i]);
    if (result.element_count() % parts != 0) {
      throw InvalidCallError("result " + std::to_string(i) + " has " + std::to_string(result.element_count()) +
                             " elements, which do not split into " + std::to_string(parts) + " equal parts");
    }
    char* const base = static_cast<char*>(result.untyped_data());
    for (size_t part = 0; part < parts; ++part) {
      given.push_back({uids[next_uid++], base + part * (result.size_bytes() / parts)});
    }
    if (layout.zeroed[i] != 0) to_zero.push_back(result);
  }
  for (size_t i = 0; i < scalar_uids.size(); ++i) {
    // cuDNN reads pass-by-value scalars from host memory when the plan is launched; the attribute
    // storage outlives the call.
    given.push_back({scalar_uids[i], const_cast<uint32_t*>(scalar_values.words + i)});
  }
  std::vector<void*> pointers = VariantPack(given, graph.variant_pack_uids);

  for (const ffi::AnyBuffer& result : to_zero) {
    CheckCuda(fe_detail::cuda_mem_set_async(result.untyped_data(), 0, result.size_bytes(), stream),
              "cudaMemsetAsync");
  }
  const cudnnHandle_t handle = thread_handle.OnStream(stream);
  const int64_t execute_start = timed ? HostTiming::NowNs() : 0;
  CheckFrontend(graph.graph.execute(handle, pointers.data(), static_cast<int>(pointers.size()),
                                    workspace.untyped_data()),
                "execute");
  return timed ? HostTiming::NowNs() - execute_start : 0;
}

ffi::Error ExecuteGraph(cudaStream_t stream, int32_t device, ffi::RemainingArgs operands,
                        ffi::RemainingRets results, std::string_view graph_key, std::string_view entry_path,
                        ffi::Span<const int64_t> uids, ffi::Span<const int64_t> result_parts,
                        ffi::Span<const int64_t> zeroed_results, ffi::Span<const int64_t> scalar_uids,
                        HostScalars scalar_values, int64_t workspace_size) {
  HostTiming& timing = State().timing;
  const bool timed = timing.enabled();
  const int64_t start = timed ? HostTiming::NowNs() : 0;
  const std::string key(graph_key);
  try {
    const int64_t cudnn_execute_ns =
        RunGraph(stream, device, operands, results, key, entry_path, uids, ResultLayout{result_parts, zeroed_results},
                 scalar_uids, scalar_values, workspace_size, timed);
    if (timed) timing.Add(HostTiming::NowNs() - start, cudnn_execute_ns);
    return ffi::Error::Success();
  } catch (const InvalidCallError& error) {
    return ffi::Error::InvalidArgument("sdpagraph_execute, graph " + key + ": " + error.what());
  } catch (const std::exception& error) {
    return ffi::Error::Internal("sdpagraph_execute, graph " + key + ": " + error.what());
  } catch (...) {
    return ffi::Error::Internal("sdpagraph_execute, graph " + key + ": unknown exception");
  }
}

auto ExecuteBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .RemainingArgs()
      .RemainingRets()
      .Attr<std::string_view>("graph_key")
      .Attr<std::string_view>("entry_path")
      .Attr<ffi::Span<const int64_t>>("uids")
      .Attr<ffi::Span<const int64_t>>("result_parts")
      .Attr<ffi::Span<const int64_t>>("zeroed_results")
      .Attr<ffi::Span<const int64_t>>("scalar_uids")
      .Attr<HostScalars>("scalar_values")
      .Attr<int64_t>("workspace_size");
}

}  // namespace
}  // namespace sdpagraph

#if SDPAGRAPH_COMMAND_BUFFER_COMPATIBLE
XLA_FFI_DEFINE_HANDLER_SYMBOL(sdpagraph_execute, sdpagraph::ExecuteGraph, sdpagraph::ExecuteBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
#else
XLA_FFI_DEFINE_HANDLER_SYMBOL(sdpagraph_execute, sdpagraph::ExecuteGraph, sdpagraph::ExecuteBinding());
#endif
