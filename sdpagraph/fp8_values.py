"""How values go into and out of an FP8 dtype with a per-tensor scale: the real value of an FP8 element is
its value times its tensor's descale; values past the dtype's largest finite one saturate there (an
e4m3fn cast would give NaN, an e5m2 one inf)."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def largest(dtype: Any) -> float:
    """The largest finite value of `dtype` (448 for e4m3, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def saturate(x: Any, dtype: Any) -> Any:
    """`x` cast to `dtype`, clipped to its finite range first."""
    bound = largest(dtype)
    return jnp.clip(x, -bound, bound).astype(dtype)


def quantize(x: Any, descale: Any, dtype: Any) -> Any:
    """`x` / `descale` saturated into `dtype`."""
    return saturate(x.astype(jnp.float32) / descale, dtype)


def amax_descale(x: Any, dtype: Any) -> Any:
    """The descale that maps |x|'s largest value onto `dtype`'s largest (current scaling); 1 for all-zero x."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    return jnp.where(amax > 0, amax / largest(dtype), 1.0)
