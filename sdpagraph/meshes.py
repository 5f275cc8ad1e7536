"""Mesh axis types: what the sharded paths do differently on `Explicit` axes (`jax.make_mesh`'s
default), where an array's type carries its sharding and ops that move data along a sharded axis
must say where the result lives. Shared by all layers; imports nothing from sdpagraph."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def explicit_axes(x: Any) -> tuple[str, ...]:
    """The Explicit axes of the mesh in `x`'s type (none on Auto axes, or in a JAX without them)."""
    typeof = getattr(jax, "typeof", None)
    mesh = getattr(getattr(typeof(x), "sharding", None), "mesh", None) if typeof is not None else None
    return tuple(getattr(mesh, "explicit_axes", ()))


def inside_full_shard_map() -> bool:
    """Whether the code is being traced inside a `shard_map` that is manual over every axis of its
    mesh (each device runs what is traced on its own shard)."""
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()))
    return bool(names) and set(names) <= set(getattr(mesh, "manual_axes", ()))


def whole_along_sequence(ids: Any) -> Any:
    """(B, T) `ids` split over Explicit axes along T, resharded to keep only their batch split: the
    segment helpers shift ids along the sequence, which a sequence-sharded type does not allow.
    Anything else comes back as it is."""
    if ids is None or not explicit_axes(ids):
        return ids
    sharding = jax.typeof(ids).sharding
    spec = tuple(sharding.spec)
    if len(spec) < 2 or spec[1] is None:
        return ids
    return jax.sharding.reshard(ids, NamedSharding(sharding.mesh, P(*spec[:1])))


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes (inside a `shard_map`) `x`'s value varies over."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset(getattr(aval, "vma", ()))


def varying_like(x: Any, operands: Any, axes: Any = ()) -> Any:
    """`x` typed as varying over every manual mesh axis some operand varies over, and over `axes`.
    Inside a `shard_map`, an FFI call's results come back invariant whatever its operands are, and a
    custom_vjp's gradient must carry its primal's manual axes; a value replicated over axes it is
    then typed as varying over has its gradient summed over them by this cast's transpose."""
    wanted = frozenset(axes).union(*(varying_axes(op) for op in operands if op is not None and hasattr(op, "shape")))
    missing = tuple(sorted(wanted - varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # the older name


def struct_like(shape: tuple[int, ...], dtype: Any, operands: Any) -> jax.ShapeDtypeStruct:
    """A Pallas call's output type, varying over every manual mesh axis some operand varies over:
    inside a `shard_map` that checks those axes, a Pallas output must say how it varies."""
    manual = getattr(jax.typeof(varying_like(jnp.zeros((), jnp.int8), operands)), "manual_axis_type", None)
    if manual is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)
