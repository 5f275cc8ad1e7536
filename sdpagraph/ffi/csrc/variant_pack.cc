// The variant pack: matching a call's (uid, pointer) pairs to the tensors a graph needs.
#include "variant_pack.h"

#include <string>

#include "errors.h"

namespace sdpagraph {

std::vector<void*> VariantPack(const std::vector<TensorPointer>& given, const std::vector<int64_t>& needed) {
  for (size_t i = 0; i < given.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (given[j].uid == given[i].uid) {
        throw InvalidCallError("uid " + std::to_string(given[i].uid) + " is given twice");
      }
    }
  }
  std::vector<void*> pointers;
  pointers.reserve(needed.size());
  for (const int64_t uid : needed) {
    const TensorPointer* match = nullptr;
    for (const TensorPointer& candidate : given) {
      if (candidate.uid == uid) match = &candidate;
    }
    if (match == nullptr) {
      throw InvalidCallError("the graph needs uid " + std::to_string(uid) +
                             ", which is not among the operands, results or scalars");
    }
    pointers.push_back(match->pointer);
  }
  if (given.size() != needed.size()) {
    for (const TensorPointer& candidate : given) {
      bool is_needed = false;
      for (const int64_t uid : needed) is_needed = is_needed || uid == candidate.uid;
      if (!is_needed) {
        throw InvalidCallError("uid " + std::to_string(candidate.uid) + " is not a tensor of this graph");
      }
    }
  }
  return pointers;
}

}  // namespace sdpagraph
