"""The C++ XLA FFI executor: loading it and registering graphs with it (see loader.py)."""
from sdpagraph.ffi.loader import (EXECUTOR_TARGET, ExecutorLib, deserialize_count, load, register_graph,
                                  unavailable_reason)

__all__ = ["EXECUTOR_TARGET", "ExecutorLib", "deserialize_count", "load", "register_graph", "unavailable_reason"]
