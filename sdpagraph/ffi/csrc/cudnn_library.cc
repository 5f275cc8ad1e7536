// cuDNN library: binding the frontend to the libcudnn JAX already loaded.
//
// Nothing CUDA is linked. cuDNN: the frontend reaches it through cudnn_dlhandle, which points at the
// libcudnn.so.9 JAX's CUDA plugin has already loaded (RTLD_NOLOAD finds it by soname), so the
// process keeps one cuDNN and one build of this library serves every cuDNN 9.x. The CUDA runtime,
// the driver and NVRTC the frontend dlopens itself, by soname: libcudart.so.12 or .13 (the copy
// JAX loaded; if both majors are loaded it warns and takes 12, and CUDNN_FRONTEND_CUDART_LIB_NAME
// picks one), libcuda.so.1, libnvrtc. The executor's own CUDA calls go through the same shims.
#include "cudnn_library.h"

#include <dlfcn.h>

#include <string>

namespace cudnn_frontend {
// With NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING the frontend resolves every cuDNN function with
// dlsym(cudnn_dlhandle, ...) and leaves defining and setting this handle to the embedding library.
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace sdpagraph {

void BindCudnnLibrary() {
  static const std::string failure = [] {
    constexpr const char* kCudnnSoname = "libcudnn.so.9";
    void* library = dlopen(kCudnnSoname, RTLD_NOW | RTLD_NOLOAD);
    if (library == nullptr) {
      library = dlopen(kCudnnSoname, RTLD_NOW);
    }
    if (library == nullptr) {
      const char* reason = dlerror();
      return std::string("cannot load ") + kCudnnSoname + ": " + (reason ? reason : "unknown error") +
             " (JAX's CUDA plugin normally loads it: is jax installed with CUDA support?)";
    }
    cudnn_frontend::cudnn_dlhandle = library;
    return std::string();
  }();
  if (!failure.empty()) {
    throw ExecutorError(failure);
  }
}

}  // namespace sdpagraph
