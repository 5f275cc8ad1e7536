"""The conformance suite's cases, and what each backend declares it runs (references: references.py).

Every case draws fresh random inputs from a seed of its own (`seed_of`: the case, its size and SDPAGRAPH_TEST_SEED),
in two sizes: "small", inside the small-sequence regime (T <= 4, S <= 16, or packed with
`max_seqlen_*` hints), and "large" (T, S up to 64). A backend runs every case its declaration
(`CAPABILITIES`) does not rule out; the others it must decline (`test_conformance`), so a
declaration that no longer matches the backend fails either way.
"""
from __future__ import annotations

import functools
import math
import os
import zlib
from dataclasses import dataclass, field
from typing import Callable

import jax.numpy as jnp
import numpy as np

from sdpagraph import mods
from tests import reference as ref

SIZES = ("small", "large")
DTYPES = ("float32", "bfloat16")
SHAPES = {"small": dict(B=2, T=4, S=16), "large": dict(B=2, T=48, S=64)}  # cases change some (`CASES`)
H = 16  # a multiple of 8, as cuDNN needs
BASE_SEED = int(os.environ.get("SDPAGRAPH_TEST_SEED", "0"))


# ----------------------------------------------------------------------------- declarations

@dataclass(frozen=True)
class Capabilities:
    """What one backend runs, declared once here; `declined` turns it into a reason per case."""

    max_q_len: int | None = None  # T, or max_seqlen_q when packed; None: any
    max_kv_len: int | None = None  # S, or max_seqlen_kv when packed
    packed_needs_hints: bool = False  # packed segment_ids without max_seqlen_* hints are outside its regime
    python_mods: bool = True  # runs jax.numpy mods the score_mod IR cannot express
    packed_position_mods: bool = True  # packed self-attention with chunk_size or a mod reading positions
    packed_cross_mods: bool = True  # packed cross-attention segments with a score_mod or chunk_size
    gpu_dtypes: tuple[str, ...] | None = None  # the dtypes it takes on a GPU (None: any)
    stand_in_on_cpu: bool = False  # without a GPU it runs around the XLA stand-in of conftest.py
    inference_lse: bool = True  # `Backend.attention(training=False)` returns the logsumexp
    environment: Callable[[], str | None] | None = None  # why it cannot run on this machine, or None


def _cudnn_environment() -> str | None:
    from sdpagraph import ffi
    from sdpagraph.graphs.support import environment_reason

    return environment_reason() or ffi.unavailable_reason()


CAPABILITIES = {
    "xla": Capabilities(),
    "small_seq": Capabilities(max_q_len=4, max_kv_len=32, packed_needs_hints=True, python_mods=False),
    "cudnn": Capabilities(python_mods=False, packed_position_mods=False, packed_cross_mods=False,
                          gpu_dtypes=("bfloat16", "float16"), stand_in_on_cpu=True, inference_lse=False,
                          environment=_cudnn_environment),
}


def capabilities(name: str) -> Capabilities:
    """The declaration of `name`; a backend nobody declared yet runs every case (and
    `test_every_backend_declares_its_capabilities` fails until it is declared)."""
    return CAPABILITIES.get(name, Capabilities())


def declined(name: str, call: "Call", gpu: bool) -> str | None:
    """Why backend `name` does not run `call`, by its declaration; None when it must run it."""
    cap, f = capabilities(name), call.features
    if cap.environment is not None and (gpu or not cap.stand_in_on_cpu):
        reason = cap.environment()
        if reason:
            return f"unavailable here: {reason}"
    if gpu and cap.gpu_dtypes is not None and call.dtype not in cap.gpu_dtypes:
        return f"takes {'/'.join(cap.gpu_dtypes)} on a GPU, not {call.dtype}"
    if "python_mod" in f and not cap.python_mods:
        return "runs no jax.numpy mod the score_mod IR cannot express"
    packed = bool(f & {"packed_self", "packed_cross"})
    hint_q, hint_kv = call.kwargs.get("max_seqlen_q"), call.kwargs.get("max_seqlen_kv")
    if packed and cap.packed_needs_hints and hint_q is None and hint_kv is None:
        return "packed segment_ids need max_seqlen_q / max_seqlen_kv hints"
    q_len = hint_q if packed and hint_q is not None else call.q.shape[1]
    kv_len = hint_kv if packed and hint_kv is not None else call.k.shape[1]
    if cap.max_q_len is not None and q_len > cap.max_q_len:
        return f"query length {q_len} > {cap.max_q_len}"
    if cap.max_kv_len is not None and kv_len > cap.max_kv_len:
        return f"key length {kv_len} > {cap.max_kv_len}"
    if "packed_self" in f and not cap.packed_position_mods and f & {"positions_mod", "chunk"}:
        return "packed self-attention with chunk_size or a score_mod reading positions"
    if "packed_cross" in f and not cap.packed_cross_mods and f & {"score_mod", "chunk"}:
        return "packed cross-attention segments with a score_mod or chunk_size"
    return None


# ----------------------------------------------------------------------------- cases

@dataclass
class Parts:
    """What a case adds to plain attention (see `CASES`)."""

    kwargs: dict = field(default_factory=dict)  # sdpagraph.attention's, besides q, k, v, bias
    features: set = field(default_factory=set)
    bias: np.ndarray | None = None
    mask: np.ndarray | None = None  # boolean, broadcastable to (B, N, T, S): mask and mask_mod, for the reference
    allowed: dict = field(default_factory=dict)  # tests.reference.allowed's arguments
    mod: ref.Mod = field(default_factory=lambda: ref.IDENTITY)  # the score_mod in NumPy
    jax: dict | None = None  # jax.nn.dot_product_attention's arguments for the case; None: it cannot express it
    jax_bias: Callable | None = None  # (q_pos, k_pos) -> an additive score_mod as a bias for jax


def _segments(rng, batch: int, length: int, max_len: int) -> np.ndarray:
    """Self-attention ids: runs numbered 1, 2, ... of 1..max_len tokens, then 1-2 padding tokens."""
    ids = np.zeros((batch, length), np.int32)
    for row in ids:
        pos, run, end = 0, 0, length - int(rng.integers(1, 3))
        while pos < end:
            n = min(int(rng.integers(1, max_len + 1)), end - pos)
            run += 1
            row[pos:pos + n] = run
            pos += n
    return ids


def _cross_segments(rng, batch: int, length: int, count: int, max_len: int) -> np.ndarray:
    """`count` runs per row, numbered 1..count, of 1..max_len tokens, and at least one padding token."""
    ids = np.zeros((batch, length), np.int32)
    for row in ids:
        lens = rng.integers(1, max_len + 1, count)
        while lens.sum() > length - 1:
            lens[np.argmax(lens)] -= 1
        row[:lens.sum()] = np.repeat(np.arange(1, count + 1), lens)
    return ids


def _longest(ids: np.ndarray) -> int:
    return max(int(np.sum(row == i)) for row in ids for i in np.unique(row[row > 0]))


def _alibi(rng, d):
    slopes = rng.uniform(0.1, 0.6, d["N"]).astype(np.float32)
    traced = jnp.asarray(slopes)
    return (lambda s, b, h, q_idx, kv_idx: s + traced[h] * (kv_idx - q_idx)), slopes


def _packed_self(rng, d, size, parts: Parts, causal: bool = True) -> Parts:
    ids = _segments(rng, d["B"], d["T"], 4 if size == "small" else 24)
    parts.kwargs.update(segment_ids=ids, is_causal=causal)
    if size == "small":
        parts.kwargs.update(max_seqlen_q=_longest(ids), max_seqlen_kv=_longest(ids))
    parts.features |= {"packed_self"} | ({"causal"} if causal else set())
    parts.allowed.update(q_ids=ids, kv_ids=ids, max_segments=d["T"], is_causal=causal)
    return parts


def _jax_segment_mask(q_ids, kv_ids):
    return ((q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] > 0))[:, None]


def _case_packed(rng, d, size):
    parts = _packed_self(rng, d, size, Parts())
    ids = parts.kwargs["segment_ids"]  # runs numbered apart: equal ids are one segment
    parts.jax = dict(mask=_jax_segment_mask(ids, ids), is_causal=True)  # same starts: causal is absolute
    return parts


def _case_packed_cross(rng, d, size):
    count, (max_q, max_kv) = (2, (2, 7)) if size == "small" else (3, (15, 20))
    q_ids, kv_ids = _cross_segments(rng, d["B"], d["T"], count, max_q), _cross_segments(rng, d["B"], d["S"], count,
                                                                                        max_kv)
    parts = Parts(kwargs=dict(segment_ids=(q_ids, kv_ids)), features={"packed_cross"},
                  allowed=dict(q_ids=q_ids, kv_ids=kv_ids, max_segments=d["T"]),
                  jax=dict(mask=_jax_segment_mask(q_ids, kv_ids)))
    if size == "small":
        parts.kwargs.update(max_seqlen_q=_longest(q_ids), max_seqlen_kv=_longest(kv_ids))
    return parts


def _case_packed_softcap(rng, d, size):
    parts = _packed_self(rng, d, size, Parts(kwargs=dict(score_mod=mods.softcap(1.5)), mod=ref.softcap_mod(1.5)))
    parts.features.add("score_mod")
    return parts


def _case_packed_alibi(rng, d, size):
    score_mod, slopes = _alibi(rng, d)
    parts = _packed_self(rng, d, size, Parts(kwargs=dict(score_mod=score_mod), mod=ref.alibi_mod(slopes)),
                         causal=False)
    parts.features |= {"score_mod", "positions_mod"}
    return parts


def _case_padding(rng, d, size):
    q_len = rng.integers(1, d["T"] + 1, d["B"]).astype(np.int32)
    kv_len = rng.integers(1, d["S"] + 1, d["B"]).astype(np.int32)
    q_len[0], kv_len[-1] = rng.integers(1, d["T"]), rng.integers(1, d["S"])  # some padding on each side
    lengths = dict(query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
    return Parts(kwargs=dict(lengths), features={"padding"}, jax=dict(lengths),
                 allowed=dict(q_lengths=q_len, kv_lengths=kv_len))


def _bias(shape: str):
    def case(rng, d, size):
        bias = (0.5 * rng.standard_normal(tuple(d[axis] if axis in d else 1 for axis in shape))).astype(np.float32)
        return Parts(kwargs=dict(scale=0.3), features={"bias"}, bias=bias, jax=dict(scale=0.3))
    return case


def _case_mask(rng, d, size):
    mask = rng.random((d["B"], 1, d["T"], d["S"])) < 0.75
    mask[0, 0, 1, :] = False  # a row with nothing to attend: 0 out, -inf logsumexp
    return Parts(kwargs=dict(mask=mask), features={"mask"}, mask=mask, jax=dict(mask=mask))


def _case_mask_mod(rng, d, size):
    offset = int(rng.integers(0, 3))

    def mask_mod(b, h, q_idx, kv_idx):  # query 1 attends nothing: 0 out, -inf logsumexp
        return ((q_idx + 2 * kv_idx + offset) % 3 != 0) & (q_idx != 1)

    grid = mask_mod(*np.ix_(np.arange(1), np.arange(1), np.arange(d["T"]), np.arange(d["S"])))
    return Parts(kwargs=dict(mask_mod=mask_mod), features={"mask_mod"}, mask=grid, jax=dict(mask=grid))


def _case_python_mod(rng, d, size):
    table = (0.5 * rng.standard_normal(max(d["T"], d["S"]))).astype(np.float32)
    traced = jnp.asarray(table)
    return Parts(kwargs=dict(score_mod=lambda s, b, h, q_idx, kv_idx: s + traced[jnp.abs(q_idx - kv_idx)]),
                 features={"score_mod", "positions_mod", "python_mod"},
                 mod=ref.Mod(lambda s, b, h, q, k: s + table[np.abs(q - k)], lambda s, *_: np.ones_like(s)),
                 jax={}, jax_bias=lambda qp, kp: table[np.abs(qp[:, None] - kp[None, :])][None, None])


def _case_alibi(rng, d, size):
    score_mod, slopes = _alibi(rng, d)
    return Parts(kwargs=dict(score_mod=score_mod), features={"score_mod", "positions_mod"},
                 mod=ref.alibi_mod(slopes), jax={},
                 jax_bias=lambda qp, kp: slopes[None, :, None, None] * (kp[None, :] - qp[:, None])[None, None])


def _simple(kwargs: dict, features: set, allowed: dict | None = None, jax_ok: bool = True, mod=ref.IDENTITY):
    return lambda rng, d, size: Parts(kwargs=dict(kwargs), features=set(features), allowed=dict(allowed or {}),
                                      mod=mod, jax=dict(kwargs) if jax_ok else None)


def _window(rng, d, size):
    window = (3, 1) if size == "small" else (10, 4)
    return _simple(dict(local_window_size=window), {"window"}, dict(window=window))(rng, d, size)


def _chunked(rng, d, size):
    chunk = 2 if size == "small" else 16
    return _simple(dict(chunk_size=chunk, is_causal=True), {"chunk", "causal"}, dict(chunk=chunk, is_causal=True),
                   jax_ok=False)(rng, d, size)


SELF = {"T": "S"}  # packed self-attention: one ids array, T = S (the size's S)
# name -> ((query heads, key/value heads), changes to the size's shape, parts(rng, dims, size))
CASES: dict[str, tuple[tuple[int, int], dict, Callable[..., Parts]]] = {
    "plain": ((2, 2), {}, _simple({}, set())),
    "decode": ((2, 2), {"T": 1}, _simple({}, set())),  # on a GPU, the small-sequence kernel's shape
    "causal": ((2, 2), {}, _simple(dict(is_causal=True), {"causal"}, dict(is_causal=True))),
    "causal_bottom_right": ((2, 2), {}, _simple(dict(is_causal=True, causal_alignment="bottom_right"),
                                                {"causal", "bottom_right"},
                                                dict(is_causal=True, alignment="bottom_right"), jax_ok=False)),
    "gqa": ((4, 2), {}, _simple({}, {"gqa"})),
    "padding": ((2, 2), {}, _case_padding),
    "bias": ((2, 2), {}, _bias("1NTS")),
    "bias_broadcast": ((4, 2), {}, _bias("B11S")),
    "mask": ((2, 2), {}, _case_mask),
    "window": ((2, 2), {}, _window),
    "chunked": ((2, 2), {}, _chunked),
    "softcap": ((2, 2), {}, _simple(dict(score_mod=mods.softcap(1.5)), {"score_mod"}, jax_ok=False,
                                    mod=ref.softcap_mod(1.5))),
    "jnp_alibi": ((4, 2), {}, _case_alibi),
    "mask_mod": ((2, 2), {}, _case_mask_mod),
    "python_mod": ((2, 2), {}, _case_python_mod),
    "packed": ((2, 2), SELF, _case_packed),
    "packed_cross": ((2, 2), {}, _case_packed_cross),
    "packed_softcap": ((4, 2), SELF, _case_packed_softcap),
    "packed_alibi": ((4, 2), SELF, _case_packed_alibi),
}


@dataclass(frozen=True, eq=False)
class Call:
    """One case, drawn: inputs (rounded to `dtype`, held in float32), the call's other arguments,
    what the references need."""

    name: str
    size: str
    dtype: str
    seed: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    bias: np.ndarray | None
    cotangent: np.ndarray
    kwargs: dict
    features: frozenset
    parts: Parts

    @property
    def scale(self) -> float:
        return self.kwargs.get("scale") or 1.0 / math.sqrt(self.q.shape[-1])

    def arrays(self) -> tuple:
        """(q, k, v[, bias]) as jax arrays of the case's dtype."""
        dtype = jnp.dtype(self.dtype)
        return tuple(jnp.asarray(x, dtype) for x in (self.q, self.k, self.v, self.bias) if x is not None)

    def where(self) -> str:
        return f"case {self.name}/{self.size}/{self.dtype}, seed {self.seed} (SDPAGRAPH_TEST_SEED={BASE_SEED})"


def seed_of(name: str, size: str) -> int:
    return (zlib.crc32(f"{name}/{size}".encode()) + BASE_SEED) % 2**32


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.dtype(dtype)).astype(jnp.float32))


@functools.lru_cache(maxsize=None)
def draw(name: str, size: str, dtype: str = "float32") -> Call:
    """The case's inputs: the same draw for every backend (and dtype: bf16 rounds the float32 one)."""
    (n, k), changes, build = CASES[name]
    seed = seed_of(name, size)
    rng = np.random.default_rng(seed)
    d = dict(SHAPES[size], N=n, K=k)
    d.update({axis: d[value] if isinstance(value, str) else value for axis, value in changes.items()})
    q = rng.standard_normal((d["B"], d["T"], n, H)).astype(np.float32)
    key, value = (rng.standard_normal((d["B"], d["S"], k, H)).astype(np.float32) for _ in range(2))
    cotangent = rng.standard_normal((d["B"], d["T"], n, H)).astype(np.float32)
    parts = build(rng, d, size)
    bias = None if parts.bias is None else _rounded(parts.bias, dtype)
    return Call(name, size, dtype, seed, _rounded(q, dtype), _rounded(key, dtype), _rounded(value, dtype), bias,
                cotangent, parts.kwargs, frozenset(parts.features), parts)
