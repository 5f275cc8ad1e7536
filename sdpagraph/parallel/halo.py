"""Halo attention: context parallelism for sliding windows, run inside `jax.shard_map` on one
device's block of q, k, v (the sequence split over the mesh axis `HaloPlan.axis` in natural order).

A query at global position p with the window (left, right) reads the keys [p - left, p + right]
only (causal: right is 0). Device d, holding the positions [d·L, (d+1)·L), needs only the `left` keys
before its block and the `right` keys after it: its halos. They come from the neighbouring devices,
one `jax.lax.ppermute` per device they reach into (a window wider than a block spans several), each
carrying only the tokens needed. Then ONE attention call runs the local queries over
[left halo ++ local keys ++ right halo]. Under autodiff the transpose of each ppermute sends the
halo's dk/dv back to the device that holds those keys: gradients need no code of their own.

The first (last) devices have fewer tokens before (after) them than the window reaches, so their
halos are shorter. Each device runs one of a few cases (hl, hr) of halo lengths, chosen by its index
with `lax.switch`; every case is one call of static shapes (T = L, S = hl + L + hr):
- cuDNN (`registry.primary()`): the window relative to the bottom-right diagonal, where local query i
  sits at key i + hl + hr: a causal window is the call's own; a two-sided one is (left + hr,
  right - hr). A score_mod that reads positions gets the block's global offsets as int32 operands, as
  the ring's blocks do (`ring.OFFSETS`).
- XLA (`registry.reference()`): `block_attention` with each token's global position (`TokenLayout`).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from sdpagraph.backends import registry
from sdpagraph.backends.masking import TokenLayout
from sdpagraph.call import RuntimeInputs
from sdpagraph.parallel.ring import OFFSETS, with_offsets
from sdpagraph.scoremod.forms import PythonMods
from sdpagraph.scoremod.ir import ScoreModIR, with_position_offsets
from sdpagraph.spec import UNBOUNDED, AttentionSpec



def sides(spec: AttentionSpec) -> tuple[int, int]:
    """(keys before, keys after) a query's own position that its window can read; UNBOUNDED for an
    open side. Causal calls read none after."""
    left, right = spec.window
    return left, 0 if spec.is_causal else right


def unsupported(spec: AttentionSpec, load_balanced: bool) -> str | None:
    """Why the halo strategy cannot run this call (None: it can); names the argument at fault."""
    left, right = sides(spec)
    if not spec.has_window or left == UNBOUNDED or right == UNBOUNDED:
        return ("needs a sliding window bounded on each side it reads: local_window_size=(left, 0) with "
                f"is_causal=True, or (left, right); this call has local_window_size={spec.window} "
                f"(-1: unbounded) and is_causal={spec.is_causal}")
    if load_balanced:
        return ("takes the sequence in natural order (load_balanced=False): a window gives every device "
                "the same work without load balancing")
    if spec.segments:
        return "does not take packed segment_ids; use 'ring' or 'all_to_all'"
    if spec.chunk_size is not None:
        return "does not take chunk_size; use 'ring' or 'all_to_all'"
    if spec.q_len != spec.kv_len:
        return f"needs self-attention lengths: query length T={spec.q_len} != key length S={spec.kv_len}"
    return None


@dataclass(frozen=True)
class HaloPlan:
    """Everything static about one halo call. `spec` is the call's spec with one device's batch
    (the sequence lengths stay global)."""

    spec: AttentionSpec
    axis: str
    size: int  # devices along `axis`
    backend: str  # the primary backend's name (cuDNN) or the reference's (XLA)
    score_mod: ScoreModIR | None
    scalars: tuple[tuple[str, Any], ...]
    python_mods: PythonMods | None = None

    @property
    def block(self) -> int:
        return self.spec.q_len // self.size

    @property
    def reach(self) -> tuple[int, int]:
        """(left, right) halo lengths of a device with enough neighbours: the window's sides, capped
        by the tokens that exist on the other devices."""
        most = (self.size - 1) * self.block
        return tuple(min(side, most) for side in sides(self.spec))

    def case_of(self, device: int) -> tuple[int, int]:
        """(hl, hr): the halo lengths device `device` receives."""
        left, right = self.reach
        return min(left, device * self.block), min(right, (self.size - 1 - device) * self.block)

    @functools.cached_property
    def cases(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted({self.case_of(d) for d in range(self.size)}))

    @property
    def reads_positions(self) -> bool:
        return self.score_mod is not None and self.score_mod.reads_positions

    @functools.cached_property
    def block_ir(self) -> ScoreModIR | None:
        """The score_mod of the cuDNN calls: positions shifted by the block's global offsets."""
        return with_position_offsets(self.score_mod, OFFSETS) if self.reads_positions else self.score_mod

    def block_spec(self, case: tuple[int, int]) -> AttentionSpec:
        """The spec of one case's cuDNN call: local queries, hl + L + hr keys, the window relative to
        the bottom-right diagonal (module docstring)."""
        hl, hr = case
        window = self.spec.window
        if not self.spec.is_causal:
            window = (window[0] + hr, window[1] - hr)
        return dataclasses.replace(self.spec, q_len=self.block, kv_len=hl + self.block + hr,
                                   causal_alignment="bottom_right", window=window)


# ----------------------------------------------------------------------------- the halos

def _halo(plan: HaloPlan, kv: tuple[Any, Any], length: int, before: bool) -> tuple[Any, ...]:
    """The `length` keys and values just before (`before`) or just after this device's block, from
    the devices they lie on: one ppermute per device reached, each sending only the tokens needed.
    A device with no such neighbour receives zeros there (its case never reads them)."""
    parts = []
    for step in range(1, -(-length // plan.block) + 1):
        n = min(plan.block, length - (step - 1) * plan.block)
        if before:  # the last n tokens of device d - step
            piece = tuple(x[:, plan.block - n:] for x in kv)
            pairs = [(j, j + step) for j in range(plan.size - step)]
        else:  # the first n tokens of device d + step
            piece = tuple(x[:, :n] for x in kv)
            pairs = [(j, j - step) for j in range(step, plan.size)]
        parts.append(jax.lax.ppermute(piece, plan.axis, pairs))
    if before:
        parts = parts[::-1]  # the farthest device's tokens come first
    return tuple(jnp.concatenate([p[i] for p in parts], axis=1) for i in range(len(kv)))


def _case_xla(plan: HaloPlan, case, me, q, k, v, arrays: Mapping[str, Any]) -> tuple[Any, Any]:
    hl, hr = case
    b, length = plan.spec.batch, hl + plan.block + hr
    start = me * plan.block
    q_pos = jnp.broadcast_to(start + jnp.arange(plan.block, dtype=jnp.int32), (b, plan.block))
    kv_pos = jnp.broadcast_to(start - hl + jnp.arange(length, dtype=jnp.int32), (b, length))
    every = lambda x: jnp.ones(x.shape, bool)  # noqa: E731
    layout = TokenLayout(q_pos, kv_pos, every(q_pos), every(kv_pos), None, None, 0)
    spec = dataclasses.replace(plan.spec, q_len=plan.block, kv_len=length)
    inputs = RuntimeInputs(mod_scalars=dict(plan.scalars), mod_arrays=arrays, python_mods=plan.python_mods)
    return registry.reference().block_attention(spec, q, k, v, inputs, plan.score_mod, layout)


def _case_cudnn(plan: HaloPlan, case, me, q, k, v, arrays: Mapping[str, Any]) -> tuple[Any, Any]:
    if plan.reads_positions:
        start = me * plan.block
        arrays = with_offsets(arrays, start, start - case[0])
    inputs = RuntimeInputs(mod_scalars=dict(plan.scalars), mod_arrays=arrays)
    return registry.primary().attention(plan.block_spec(case), q, k, v, inputs, plan.block_ir, training=True)


def halo_attention(plan: HaloPlan, q, k, v, arrays: Mapping[str, Any]) -> tuple[Any, Any]:
    """(output (B, L, N, Hv), logsumexp (B, N, L)) of the local queries over every key their windows
    reach. `arrays`: the score_mod arrays (B|1, N|1, 1, 1)."""
    me = jax.lax.axis_index(plan.axis)
    left, right = plan.reach
    keys, values = k, v
    if left:
        before = _halo(plan, (k, v), left, before=True)
        keys, values = (jnp.concatenate([h, x], axis=1) for h, x in zip(before, (keys, values)))
    if right:
        after = _halo(plan, (k, v), right, before=False)
        keys, values = (jnp.concatenate([x, h], axis=1) for h, x in zip(after, (keys, values)))
    run = _case_xla if plan.backend == registry.reference().name else _case_cudnn

    def branch(case):
        hl, hr = case
        present = slice(left - hl, left + plan.block + hr)  # this case's halos: the tokens that exist
        return lambda q, keys, values: run(plan, case, me, q, keys[:, present], values[:, present], arrays)

    branches = [branch(case) for case in plan.cases]
    if len(branches) == 1:
        return branches[0](q, keys, values)
    table = jnp.asarray([plan.cases.index(plan.case_of(d)) for d in range(plan.size)], jnp.int32)
    return jax.lax.switch(table[me], branches, q, keys, values)
