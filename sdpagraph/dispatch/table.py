"""Calibration tables for `dispatch`: the measured points of one GPU type, the cost models fitted
to them, and their JSON files.

The built-in tables ship as package data, `data/<gpu>.json` (e.g. `data/h100.json`, an H100 80GB
HBM3, dated and sourced point by point), in the format `tables_to_json` writes; `python
bench/dispatch.py --write-table PATH` on a GPU writes a newer one (`SDPAGRAPH_DISPATCH_TABLE=PATH`).

A shape's time is measured (a point of the same class: T, S, N, K, H, H_v, dtype and causal flag, no
other masks, bias or score_mod, batch within MEASURED_BATCH_RANGE, scaled linearly in B) or else
predicted by the backend's cost model, fitted to all the table's measurements of that backend and
pass:

    t [ms] = c0 + c_io * io_bytes + c_sc * scores + c_fl * flops + c_cta * ctas + c_tile * tiles
             + c_gemm * gemm_rows

io_bytes: Q, K, V read and O written, in the input dtype (forward+backward: twice, plus dO read
and dQ, dK, dV written), plus a bias or mask; scores: B*N*T*S (what XLA materializes); flops:
2*B*N*T*S*(H + H_v), x3.5 for forward+backward, halved by a causal mask for cuDNN, which skips
masked tiles; ctas: B*N*ceil(T/128) (one cuDNN thread block per 128 query rows: the fixed cost that
makes cuDNN slow at T=1 with a huge batch); tiles: ctas*ceil(S/128) (what cuDNN computes, padding
included); gemm_rows: B*N*T when more than one query row shares a key/value head (T*N/K > 1), else
0 (XLA turns a one-row dot into a multiply-and-sum fusion that streams K and V, and the others into
batched matrix products of tiny matrices: on an H100 B30720 T4 S16 ran 4x slower than T1).
The coefficients are non-negative least squares in relative error (`fit_model`).
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from sdpagraph.spec import AttentionSpec

PASSES = ("fwd", "fwd_bwd")
FORMAT = 1
MEASURED_BATCH_RANGE = 4.0
CUDNN_TILE = 128
FEATURES = ("c0", "io_bytes", "scores", "flops", "ctas", "tiles", "gemm_rows")
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
# The built-in table a GPU without one of its own is predicted with (`stand_in_table`).
STAND_IN_GPU = "NVIDIA H100 80GB HBM3"


# ----------------------------------------------------------------------------- shapes and features

@dataclass(frozen=True)
class Shape:
    """The part of a spec the timings depend on (a measured point's key)."""

    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: str
    causal: bool = False
    plain: bool = True  # no bias, mask, padding, window, chunk, segments or score_mod
    extra_bytes: int = 0  # a bias or mask read per pass

    @classmethod
    def of(cls, spec: AttentionSpec, has_score_mod: bool = False, packs_by_hints: bool = False) -> "Shape":
        """The shape a backend computes: for one that `packs_by_hints` (cuDNN's THD graphs, small_seq), a
        packed call with `max_seqlen_q` / `max_seqlen_kv` hints is B * ceil(T / max_seqlen_q) sequences
        of the hinted lengths; for the others (XLA) it is the dense (B, T, S)."""
        batch, q_len, kv_len = spec.batch, spec.q_len, spec.kv_len
        if packs_by_hints and spec.segments and (spec.max_seqlen_q or spec.max_seqlen_kv):
            q_len, kv_len = spec.max_seqlen_q or q_len, spec.max_seqlen_kv or kv_len
            batch = spec.batch * math.ceil(spec.q_len / q_len)
        extra = 0
        for shape, size in ((spec.bias_shape, _ITEMSIZE.get(spec.dtype, 4)), (spec.mask_shape, 1)):
            if shape is not None:
                extra += size * math.prod(shape)
        plain = not (has_score_mod or spec.bias_shape or spec.mask_shape or spec.has_padding or spec.has_window
                     or spec.chunk_size is not None or spec.segments or spec.segment_mask)
        return cls(batch, q_len, kv_len, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                   spec.head_dim_v, spec.dtype, spec.is_causal, plain, extra)

    def class_key(self) -> tuple:
        return (self.q_len, self.kv_len, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim_v,
                self.dtype, self.causal)

    def summary(self) -> str:
        heads = f"N{self.num_heads}" + (f"/K{self.num_kv_heads}" if self.num_kv_heads != self.num_heads else "")
        dims = f"H{self.head_dim}" + (f"/{self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
        return (f"B{self.batch} T{self.q_len} S{self.kv_len} {heads} {dims} {self.dtype}"
                + (" causal" if self.causal else "") + ("" if self.plain else " (+masks/bias/mod)"))

    def to_dict(self) -> dict[str, Any]:
        return {"B": self.batch, "T": self.q_len, "S": self.kv_len, "N": self.num_heads, "K": self.num_kv_heads,
                "H": self.head_dim, "Hv": self.head_dim_v, "dtype": self.dtype, "causal": self.causal}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Shape":
        return cls(int(d["B"]), int(d["T"]), int(d["S"]), int(d["N"]), int(d.get("K", d["N"])), int(d["H"]),
                   int(d.get("Hv", d["H"])), str(d["dtype"]), bool(d.get("causal", False)))


def features(shape: Shape, backend: str, pass_: str) -> np.ndarray:
    """The cost model's inputs (FEATURES) for one backend and pass."""
    b, t, s, n, k = shape.batch, shape.q_len, shape.kv_len, shape.num_heads, shape.num_kv_heads
    h, hv, size = shape.head_dim, shape.head_dim_v, _ITEMSIZE.get(shape.dtype, 4)
    q, o = b * t * n * h, b * t * n * hv
    kv = b * s * k * (h + hv)
    io = size * (q + kv + o) + shape.extra_bytes
    flops = 2.0 * b * n * t * s * (h + hv)
    ctas = b * n * math.ceil(t / CUDNN_TILE)
    kv_tiles = math.ceil(s / CUDNN_TILE)
    if shape.causal and backend == "cudnn":  # cuDNN skips the tiles above the diagonal
        q_tiles = math.ceil(t / CUDNN_TILE)
        visited = sum(min(kv_tiles, i + 1 + max(0, kv_tiles - q_tiles)) for i in range(q_tiles))
        kv_tiles_total = b * n * visited
        flops *= 0.5
    else:
        kv_tiles_total = ctas * kv_tiles
    if pass_ == "fwd_bwd":
        io = 2 * io + size * (o + q + kv)  # forward, backward reads again, dO read, dQ dK dV written
        flops *= 3.5
    gemm_rows = b * n * t if t * (n // max(k, 1)) > 1 else 0  # see the module docstring
    return np.array([1.0, io / 1e9, b * n * t * s / 1e9, flops / 1e12, ctas / 1e6, kv_tiles_total / 1e6,
                     gemm_rows / 1e6])


# ----------------------------------------------------------------------------- measured points, fit

@dataclass(frozen=True)
class Point:
    """One measured shape: milliseconds per backend for one pass (absent: not run or not supported)."""

    shape: Shape
    pass_: str
    times: Mapping[str, float]
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = {"shape": self.shape.to_dict(), "pass": self.pass_, "ms": dict(self.times)}
        if self.source:
            out["source"] = self.source
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Point":
        if d["pass"] not in PASSES:
            raise ValueError(f"dispatch table point has pass {d['pass']!r}, expected one of {PASSES}")
        times = {str(name): float(ms) for name, ms in d["ms"].items() if ms is not None}
        return cls(Shape.from_dict(d["shape"]), d["pass"], times, str(d.get("source", "")))


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best non-negative solution over
    every subset of columns (exact; 2**7 tiny solves)."""
    n = a.shape[1]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    scaled = a / norms
    best, best_err = np.zeros(n), float(np.sum(y ** 2))
    for r in range(1, n + 1):
        for cols in itertools.combinations(range(n), r):
            sol, *_ = np.linalg.lstsq(scaled[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            err = float(np.sum((scaled[:, cols] @ sol - y) ** 2))
            if err < best_err - 1e-15:
                best_err, best = err, np.zeros(n)
                best[list(cols)] = sol
    return best / norms


def fit_model(points: list[Point], backend: str, pass_: str) -> np.ndarray | None:
    """Coefficients (FEATURES order) fitted to `backend`'s measured times, minimizing relative error;
    None when the points hold no time for it."""
    rows, times = [], []
    for p in points:
        if p.pass_ == pass_ and backend in p.times and p.times[backend] > 0:
            rows.append(features(p.shape, backend, pass_))
            times.append(p.times[backend])
    if not rows:
        return None
    a, t = np.array(rows), np.array(times)
    return _nnls(a / t[:, None], np.ones(len(t)))


# ----------------------------------------------------------------------------- tables

@dataclass(frozen=True)
class Table:
    """Measured points for one GPU type, and the cost models fitted to them."""

    gpu: str
    points: tuple[Point, ...]
    date: str = ""
    source: str = ""
    use_measured: bool = True  # False: predictions from the fitted models alone (to test them)
    _models: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def model(self, backend: str, pass_: str) -> np.ndarray | None:
        key = (backend, pass_)
        if key not in self._models:
            self._models[key] = fit_model(list(self.points), backend, pass_)
        return self._models[key]

    def measured(self, shape: Shape, backend: str, pass_: str) -> tuple[float, Point] | None:
        """The measured time of this shape class, scaled to the batch, from the nearest batch."""
        if not shape.plain or not self.use_measured:
            return None
        best = None
        for p in self.points:
            if p.pass_ != pass_ or backend not in p.times or p.shape.class_key() != shape.class_key():
                continue
            ratio = shape.batch / p.shape.batch
            if not 1 / MEASURED_BATCH_RANGE <= ratio <= MEASURED_BATCH_RANGE:
                continue
            distance = abs(math.log(ratio))
            if best is None or distance < best[0]:
                best = (distance, p.times[backend] * ratio, p)
        return None if best is None else (best[1], best[2])

    def predict(self, shape: Shape, backend: str, pass_: str) -> tuple[float, str] | None:
        """(milliseconds, "measured" or "model") or None when the table knows nothing of the backend."""
        hit = self.measured(shape, backend, pass_)
        if hit is not None:
            return hit[0], "measured"
        coef = self.model(backend, pass_)
        if coef is None:
            return None
        return float(features(shape, backend, pass_) @ coef), "model"

    def to_dict(self) -> dict[str, Any]:
        return {"date": self.date, "source": self.source, "points": [p.to_dict() for p in self.points]}

    @classmethod
    def from_dict(cls, gpu: str, d: Mapping[str, Any]) -> "Table":
        return cls(gpu, tuple(Point.from_dict(p) for p in d.get("points", ())), str(d.get("date", "")),
                   str(d.get("source", "")))


def _tables_from_text(text: str, where: str) -> dict[str, Table]:
    data = json.loads(text)
    if data.get("format") != FORMAT:
        raise ValueError(f"{where}: dispatch table format {data.get('format')!r}, expected {FORMAT}")
    return {gpu: Table.from_dict(gpu, table) for gpu, table in data.get("tables", {}).items()}


def tables_from_json(path: str | os.PathLike) -> dict[str, Table]:
    """Read a table file: {"format": 1, "tables": {gpu name: {"date", "source", "points": [...]}}}."""
    with open(path) as f:
        return _tables_from_text(f.read(), str(path))


@functools.cache
def builtin_tables() -> Mapping[str, Table]:
    """The tables shipped with the package, keyed by GPU name: every `data/*.json` (one file per GPU
    type, in the format `tables_to_json` writes). Read-only: it is shared by every caller."""
    tables: dict[str, Table] = {}
    for entry in sorted(resources.files(__package__).joinpath("data").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            tables.update(_tables_from_text(entry.read_text(encoding="utf-8"), f"{__package__}/data/{entry.name}"))
    return MappingProxyType(tables)


def stand_in_table() -> Table:
    """The built-in table used for a GPU that has none of its own (STAND_IN_GPU's)."""
    return builtin_tables()[STAND_IN_GPU]


def tables_to_json(tables: Mapping[str, Table], path: str | os.PathLike) -> None:
    """Write tables (keyed by GPU name) in the format `tables_from_json` reads."""
    data = {"format": FORMAT, "tables": {gpu: t.to_dict() for gpu, t in sorted(tables.items())}}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def load_table(path: str | os.PathLike, gpu: str | None = None) -> Table:
    """The table for `gpu` (default: this process's GPU) from a table file: exact name, else the one
    whose name shares the chip's model (e.g. "H100"), else the only table in the file."""
    tables = tables_from_json(path)
    found = match_table(tables, gpu if gpu is not None else current_gpu() or "")
    if found is None:
        if len(tables) == 1:
            return next(iter(tables.values()))
        raise KeyError(f"{path} has no dispatch table for GPU {gpu!r} (it has {sorted(tables)})")
    return found


def _chip(name: str) -> str | None:
    for token in name.replace("-", " ").split():
        if len(token) >= 4 and token[0].isalpha() and any(c.isdigit() for c in token):
            return token.upper()  # "H100", "H200", "A100", "B200", "GH200"
    return None


def match_table(tables: Mapping[str, Table], gpu: str) -> Table | None:
    if gpu in tables:
        return tables[gpu]
    chip = _chip(gpu)
    if chip is None:
        return None
    for name, table in tables.items():
        if _chip(name) == chip:
            return table
    return None


def current_gpu() -> str | None:
    """This process's GPU name (`device_kind` of jax's first GPU), or None without a GPU."""
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    return gpus[0].device_kind if gpus else None
