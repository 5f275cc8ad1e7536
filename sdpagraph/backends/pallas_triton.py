"""Whether this jax lowers Pallas kernels with its Triton backend: the one place that asks.

    status() -> Availability(available, reason)
    compiler_params(num_warps, interpret=False) -> the compiler parameters of a kernel (None interpreted)

jax 0.11 deprecates Pallas' Triton backend (a DeprecationWarning at each lowering) and will remove
it. Its removal can show in three ways, and one probe sees all of them: `jax.experimental.pallas.triton`
no longer imports (or its `CompilerParams` changed), or lowering a kernel with Triton's compiler
parameters raises (the backend gone from the lowering, or the deprecation turned into an error).
The probe lowers a one-line copy kernel for CUDA, which needs no GPU (so a CPU answers as a GPU
would), once per process, on first use: the kernels that use Triton (`backends.small_seq.kernel`,
`backends.cudnn.bins.packer`, `parallel.row_updates`) ask only where they would run, and run their XLA formulation when
the answer is no. jax's deprecation warning is left to the user's filters.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from sdpagraph.config import PALLAS_TRITON
from sdpagraph.logs import logger
from sdpagraph.meshes import struct_like


@dataclass(frozen=True)
class Availability:
    """`available`: Triton lowers Pallas kernels in this jax. `reason`: why not ("" when it does)."""

    available: bool
    reason: str


def status() -> Availability:
    """Whether Pallas' Triton backend lowers kernels in this jax (module docstring; probed once per
    process), unless SDPAGRAPH_PALLAS_TRITON=0 says not to use it."""
    if not PALLAS_TRITON.enabled():
        return Availability(False, f"{PALLAS_TRITON.name}=0")
    return _probe()


@functools.cache
def _probe() -> Availability:
    try:
        from jax.experimental import pallas as pl

        # The first use may come inside a shard_map's trace, whose checks want the output's manual axes.
        call = pl.pallas_call(_copy, out_shape=struct_like((16,), jnp.int32, []),
                              compiler_params=compiler_params(1))
        jax.jit(call).trace(jax.ShapeDtypeStruct((16,), jnp.int32)).lower(lowering_platforms=("cuda",))
    except Exception as error:  # any failure means the kernels cannot be lowered: say which
        first_line = (str(error).strip().splitlines() or [""])[0]
        answer = Availability(False, f"Pallas Triton unavailable in jax {jax.__version__} "
                                     f"({type(error).__name__}: {first_line})")
        logger.info("sdpagraph: %s; the Pallas kernels run their XLA formulations", answer.reason)
        return answer
    return Availability(True, "")


def compiler_params(num_warps: int, interpret: bool = False) -> Any:
    """Triton's compiler parameters for a kernel of `num_warps` warps and one pipeline stage (every
    kernel here holds its blocks in registers); None in Pallas' interpreter, which takes none."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=num_warps, num_stages=1)


def _copy(x_ref, o_ref) -> None:
    o_ref[...] = x_ref[...]
