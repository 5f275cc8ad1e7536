"""sdpagraph: flex attention for JAX on cuDNN, with compiled graphs cached and shipped.

Public API: `attention`, `check_support`, `precompile`, `Support`, `mods`, the `sdpagraph` CLI.
"""
from sdpagraph import mods
from sdpagraph.graphs.support import Support
from sdpagraph.jax_api.attention import attention, check_support
from sdpagraph.deploy import precompile, record


__all__ = ["attention", "check_support", "precompile", "record", "Support", "mods"]
__version__ = "0.1.0"
