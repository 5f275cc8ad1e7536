"""The C++ XLA FFI executor: loading it and registering graphs with it (see loader.py)."""
from sdpagraph.ffi.loader import (EXECUTOR_TARGET, ExecutorLib, build_status, deserialize_count, library_path, load,
                                  register_graph, unavailable_reason)
from sdpagraph.ffi.prepare import prepare_soon

__all__ = ["EXECUTOR_TARGET", "ExecutorLib", "build_status", "deserialize_count", "library_path", "load",
           "prepare_soon", "register_graph", "unavailable_reason"]
