"""CompiledGraph: a serialized cuDNN graph and everything needed to execute it.

It travels through the graph cache as (blob, meta): `to_meta()` gives plain msgpack
data (str keys, lists, numbers; no pickle), and `from_meta(blob, meta)` reads it back,
also after msgpack turned tuples into lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from sdpagraph.scoremod.scale_folding import folded_scale

# Bump when the meta layout below changes, so old cache entries are rejected clearly.
META_VERSION = 1


@dataclass(frozen=True)
class CompiledGraph:
    """One built cuDNN SDPA graph.

    blob:           serialized cuDNN backend plan (`pygraph.serialize`)
    workspace_size: bytes of device workspace `execute` needs
    operand_roles:  device inputs in FFI order (see `graphs.operands.graph_io`)
    result_roles:   device outputs in FFI order
    uids:           role -> cuDNN tensor UID, for operands, results and pass-by-value tensors
    pass_by_value:  (uid, source, dtype) of each [1,1,1,1] host-bound tensor: source is
                    ("scalar", name), bound from score_mod_tensors at run time,
                    ("const", value), a literal of the mod, or ("attn_scale", (scale, name,
                    op)), the attention scale `scale` divided ("div") or multiplied ("mul") by
                    the scalar `name` at run time (`scoremod.scale_folding`); dtype
                    ("float32") is how the executor must encode the value
    direction:      "forward", "inference" or "backward"
    versions:       {"cudnn", "frontend", "gpu"} the plan was built for
    build_time_s:   seconds the build took
    """

    blob: bytes
    workspace_size: int
    operand_roles: tuple[str, ...]
    result_roles: tuple[str, ...]
    uids: dict[str, int]
    pass_by_value: tuple[tuple[int, tuple[str, Any], str], ...]
    direction: str
    versions: dict[str, str]
    build_time_s: float

    def to_meta(self) -> dict[str, Any]:
        """Everything but the blob, as msgpack-able plain data."""
        return {
            "meta_version": META_VERSION,
            "workspace_size": self.workspace_size,
            "operand_roles": list(self.operand_roles),
            "result_roles": list(self.result_roles),
            "uids": dict(self.uids),
            "pass_by_value": [[uid, kind, value, dtype] for uid, (kind, value), dtype in self.pass_by_value],
            "direction": self.direction,
            "versions": dict(self.versions),
            "build_time_s": self.build_time_s,
        }

    @classmethod
    def from_meta(cls, blob: bytes, meta: Mapping[str, Any]) -> "CompiledGraph":
        if meta.get("meta_version") != META_VERSION:
            raise ValueError(f"graph meta version {meta.get('meta_version')!r}, this sdpagraph reads {META_VERSION}")
        return cls(
            blob=bytes(blob),
            workspace_size=int(meta["workspace_size"]),
            operand_roles=tuple(meta["operand_roles"]),
            result_roles=tuple(meta["result_roles"]),
            uids={str(role): int(uid) for role, uid in meta["uids"].items()},
            pass_by_value=tuple((int(uid), (str(kind), tuple(value) if isinstance(value, list) else value), str(dtype))
                                for uid, kind, value, dtype in meta["pass_by_value"]),
            direction=str(meta["direction"]),
            versions={str(k): str(v) for k, v in meta["versions"].items()},
            build_time_s=float(meta["build_time_s"]),
        )

    def pass_by_value_values(self, scalars: Mapping[str, Any]) -> dict[int, np.generic]:
        """uid -> typed host value of every pass-by-value tensor; scalars come from `scalars` by name."""
        values = {}
        for uid, (kind, source), dtype in self.pass_by_value:
            if kind == "const":
                values[uid] = np.dtype(dtype).type(source)
                continue
            name = source if kind == "scalar" else source[1]  # "attn_scale": (scale, name, op)
            if name not in scalars:
                raise KeyError(f"score_mod scalar {name!r} has no value; got {sorted(scalars)}")
            value = scalars[name] if kind == "scalar" else folded_scale(source[0], scalars[name], source[2])
            values[uid] = np.dtype(dtype).type(value)
        return values


def scalar_bits(compiled: CompiledGraph, scalars: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(uids, 4-byte host representation of each pass-by-value scalar, as int32 bit patterns)."""
    values = compiled.pass_by_value_values(scalars)
    uids = np.array(sorted(values), np.int64)
    bits = np.array([np.array(values[u]).view(np.int32) for u in uids], np.int32)  # values are 4-byte typed
    return uids, bits.reshape(-1)
