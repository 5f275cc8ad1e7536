"""The C++ XLA FFI executor: loading it and registering graphs with it (see loader.py)."""
from sdpagraph.ffi.loader import ExecutorLib, deserialize_count, load, register_graph, unavailable_reason

__all__ = ["ExecutorLib", "deserialize_count", "load", "register_graph", "unavailable_reason"]
