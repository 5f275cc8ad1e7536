// The variant pack: the tensor pointers of one run of a graph, in the order its execute() takes them.
// Shared by the execute handler (execute.cc) and direct runs (direct.cc).
#ifndef SDPAGRAPH_FFI_CSRC_VARIANT_PACK_H_
#define SDPAGRAPH_FFI_CSRC_VARIANT_PACK_H_

#include <cstdint>
#include <vector>

namespace sdpagraph {

struct TensorPointer {
  int64_t uid;
  void* pointer;
};

// Orders the call's pointers the way the graph's execute() takes them, and rejects a call that
// misses a tensor of the graph, names one twice, or names one the graph does not have.
std::vector<void*> VariantPack(const std::vector<TensorPointer>& given, const std::vector<int64_t>& needed);

}  // namespace sdpagraph

#endif  // SDPAGRAPH_FFI_CSRC_VARIANT_PACK_H_
