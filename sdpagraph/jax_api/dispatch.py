"""Which backend runs an attention call: the fastest one that can, by measurement.

A backend that can run a call is not necessarily a good choice: on an H100, cuDNN builds the graphs
of B30720 T1 S16 N16 H128 and runs them 3.3x (forward) / 3.6x (forward+backward) slower than plain
XLA, 11x / 9x at S4 (issue 14). So `attention` asks this module, with the backends that can run the
call, which one to use.

The rule (`choose`):

1. `implementation="xla" | "cudnn" | "small_seq"` forces that backend (ValueError with its reason when
   it cannot run the call). `implementation=None` chooses:
2. Among the candidates that can run the call, predict each one's time for the call's pass ("fwd"
   for a call that is not differentiated, `training=False`; "fwd_bwd" otherwise) and take the smallest.
3. A prediction is a measurement when the calibration table holds one of this shape class: the same
   T, S, N, K, H, H_v, dtype and causal flag, no other masks, bias or score_mod, and a batch within a
   factor MEASURED_BATCH_RANGE of the measured one; the measured time is scaled linearly in B (the
   nearest measured batch is used). Otherwise it is the backend's cost model, fitted to all the
   table's measurements of that backend and pass:

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
   A model ranks only inside the region its fit was measured in (MODEL_MAX_Q_LEN, MODEL_MAX_KV_LEN);
   elsewhere only measurements rank, so an extrapolation never displaces cuDNN. A packed call with
   `max_seqlen_q` / `max_seqlen_kv` hints is predicted, for cuDNN and small_seq, as the sequences its
   hints bound (`Shape.of`), and for XLA as the dense (B, T, S) it computes.
4. A candidate with no measurement and no (trusted) model (the table has no data for that backend and pass)
   gets no prediction and ranks after every predicted one; among those, FALLBACK_ORDER decides
   (cuDNN when it can run the call, else XLA: the behaviour before this rule). Ties too.
5. A candidate may be given lazily (a callable returning its answer): it is asked only when it is
   the fastest predicted of those not yet ruled out, so a call where cuDNN is predicted slower never
   builds cuDNN graphs to find out whether cuDNN could run it.

The table (`Table`): measured points for one GPU type. Built in: `H100_TABLE` (dated and sourced
below). `SDPAGRAPH_DISPATCH_TABLE=path.json` (written by `python bench/dispatch.py --write-table
path.json` on the GPU) adds or replaces tables by GPU name (`jax.Device.device_kind`). A GPU with no
table uses the H100 one (and the reason says so); a machine without a GPU uses no table (cuDNN does
not run there, and the XLA backend, the reference, is preferred by FALLBACK_ORDER).
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from sdpagraph.spec import AttentionSpec

BACKENDS = ("cudnn", "xla", "small_seq")
PASSES = ("fwd", "fwd_bwd")
FALLBACK_ORDER = ("cudnn", "xla", "small_seq")
FORMAT = 1
ENV_TABLE = "SDPAGRAPH_DISPATCH_TABLE"
MEASURED_BATCH_RANGE = 4.0
# Where the cost models are trusted to rank backends: the region their fits were measured in (the
# small-sequence sweep). Elsewhere a model-only prediction does not rank: measured points do, then
# FALLBACK_ORDER (cuDNN when it runs the call). Widen once bench/dispatch.py's crossover sweep
# (T <= 16, S <= 256) has been run on the GPU and fitted.
MODEL_MAX_Q_LEN = 4
MODEL_MAX_KV_LEN = 32
CUDNN_TILE = 128
FEATURES = ("c0", "io_bytes", "scores", "flops", "ctas", "tiles", "gemm_rows")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    def of(cls, spec: AttentionSpec, has_score_mod: bool = False, backend: str | None = None) -> "Shape":
        """The shape `backend` computes: a packed call with `max_seqlen_q` / `max_seqlen_kv` hints is,
        for cuDNN (THD) and small_seq, B * ceil(T / max_seqlen_q) sequences of the hinted lengths; the
        XLA backend (and `backend=None`) computes the dense (B, T, S)."""
        batch, q_len, kv_len = spec.batch, spec.q_len, spec.kv_len
        if backend in ("cudnn", "small_seq") and spec.segments and (spec.max_seqlen_q or spec.max_seqlen_kv):
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


def tables_from_json(path: str | os.PathLike) -> dict[str, Table]:
    """Read a table file: {"format": 1, "tables": {gpu name: {"date", "source", "points": [...]}}}."""
    with open(path) as f:
        data = json.load(f)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: dispatch table format {data.get('format')!r}, expected {FORMAT}")
    return {gpu: Table.from_dict(gpu, table) for gpu, table in data.get("tables", {}).items()}


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


@functools.lru_cache(maxsize=8)
def _default_table(gpu: str | None, env_path: str) -> tuple[Table | None, str]:
    if gpu is None:
        return None, "no GPU: no calibration table"
    tables = {H100_TABLE.gpu: H100_TABLE}
    if env_path:
        tables.update(tables_from_json(env_path))
    found = match_table(tables, gpu)
    if found is not None:
        return found, ""
    return H100_TABLE, f"no table for {gpu}; using the {H100_TABLE.gpu} one"


def default_table() -> tuple[Table | None, str]:
    """(the table for this process's GPU, a note when it is a stand-in), `SDPAGRAPH_DISPATCH_TABLE` first."""
    return _default_table(current_gpu(), os.environ.get(ENV_TABLE, ""))


# ----------------------------------------------------------------------------- the rule

@dataclass(frozen=True)
class Choice:
    """The backend `choose` picked, why (one sentence with the numbers), and the numbers: predicted
    milliseconds of each candidate that can run the call (None where the table has no data)."""

    backend: str
    reason: str
    numbers: Mapping[str, float | None]
    pass_: str = "fwd_bwd"


def _can_run(answer: Any) -> bool:
    supported = getattr(answer, "supported", answer)
    return bool(supported)


def _why_not(answer: Any) -> str:
    return getattr(answer, "reason", None) or "not supported"


def _model_trusted(shape: Shape) -> bool:
    return shape.q_len <= MODEL_MAX_Q_LEN and shape.kv_len <= MODEL_MAX_KV_LEN


def _rank(name: str) -> int:
    return FALLBACK_ORDER.index(name) if name in FALLBACK_ORDER else len(FALLBACK_ORDER)


class _Candidates:
    """The candidates' answers, asking a lazy one (a callable) only when the rule needs it."""

    def __init__(self, candidates: Mapping[str, Any]):
        self._given = dict(candidates)
        self._answers = {name: a for name, a in self._given.items() if not callable(a)}

    def answer(self, name: str) -> Any:
        if name not in self._answers:
            self._answers[name] = self._given[name]()
        return self._answers[name]

    def names(self) -> list[str]:
        return list(self._given)

    def known(self, name: str) -> bool:
        return name in self._answers

    def may_run(self, name: str) -> bool:
        """True when it runs the call or has not been asked yet."""
        return not self.known(name) or _can_run(self._answers[name])


def choose(spec: AttentionSpec, candidates: Mapping[str, Any], table: Table | None = None, *,
           implementation: str | None = None, training: bool = True, has_score_mod: bool = False,
           use_default_table: bool = True) -> Choice:
    """Pick the backend for `spec` among `candidates`. See the module docstring for the rule.

    `candidates`: name -> a `Support`-like answer (`.supported`, `.reason`), a bool, or a callable
    returning one, asked only when that backend would be picked (cuDNN's answer builds graphs: a
    call that cuDNN would run slower never needs it). `table`: the calibration; None uses
    `default_table()` (unless `use_default_table=False`). Raises ValueError when `implementation`
    names a backend that cannot run the call, or when no candidate can.
    """
    pass_ = "fwd_bwd" if training else "fwd"
    what = "forward+backward" if training else "forward"
    shape = Shape.of(spec, has_score_mod)
    note = ""
    if table is None and use_default_table:
        table, note = default_table()
    answers = _Candidates(candidates)
    numbers: dict[str, float | None] = {}
    sources: dict[str, str] = {}
    for name in answers.names():
        if not answers.may_run(name):
            continue
        computed = Shape.of(spec, has_score_mod, name)  # a packed call's differs by backend
        predicted = None if table is None else table.predict(computed, name, pass_)
        if predicted is not None and predicted[1] == "model" and not _model_trusted(computed):
            predicted = None  # outside the region the models were fitted in: do not rank by them
        numbers[name] = None if predicted is None else predicted[0]
        if predicted is not None:
            sources[name] = predicted[1]
    table_name = "no table" if table is None else f"the {table.gpu} table" + (f" ({table.date})" if table.date else "")
    if note:
        table_name += f"; {note}"

    def listing(names) -> str:
        return ", ".join(f"{name} {numbers[name]:.3g} ms ({sources[name]})" for name in names
                         if numbers.get(name) is not None)

    if implementation is not None:
        if implementation not in candidates:
            raise ValueError(f"implementation={implementation!r} is not one of the candidates {sorted(candidates)}")
        answer = answers.answer(implementation)
        if not _can_run(answer):
            raise ValueError(f"implementation={implementation!r} cannot run {spec.summary()}: {_why_not(answer)}")
        known = listing(numbers)
        tail = f" (predicted {what}: {known}; {table_name})" if known else ""
        return Choice(implementation, f"implementation={implementation!r} was requested{tail}", numbers, pass_)

    # The fastest predicted first (ties and unpredicted ones by FALLBACK_ORDER); ask lazy candidates
    # in that order until one runs the call.
    order = sorted(numbers, key=lambda name: (numbers[name] is None, numbers[name] or 0.0, _rank(name)))
    best = next((name for name in order if _can_run(answers.answer(name))), None)
    if best is None:
        why = "; ".join(f"{name}: {_why_not(answers.answer(name))}" for name in answers.names())
        raise ValueError(f"no backend can run {spec.summary()}: {why}")
    declined = [name for name in answers.names() if answers.known(name) and not _can_run(answers.answer(name))]
    not_asked = [name for name in answers.names() if not answers.known(name)]
    notes = ""
    if declined:
        notes += f"; {', '.join(declined)} cannot run it"
    if not_asked:
        notes += f"; {', '.join(not_asked)} not asked (predicted slower)"
    runnable = [name for name in numbers if name not in declined]
    if numbers[best] is None:
        reason = (f"{best}: no timing data for {shape.summary()} {what} ({table_name}); preference order "
                  f"{', '.join(FALLBACK_ORDER)}{notes}")
        return Choice(best, reason, {n: numbers[n] for n in runnable}, pass_)
    unknown = [name for name in runnable if numbers[name] is None]
    if unknown:
        notes += f"; no data for {', '.join(unknown)}"
    reason = (f"{best} is the fastest predicted for {shape.summary()} {what} on {table_name}: "
              f"{listing(runnable)}{notes}")
    return Choice(best, reason, {n: numbers[n] for n in runnable}, pass_)


# ----------------------------------------------------------------------------- the built-in table

def _points(rows: list[tuple], source: str) -> tuple[Point, ...]:
    """rows: (B, T, S, N, K, H, causal, pass, {backend: ms})."""
    return tuple(Point(Shape(b, t, s, n, k, h, h, "bfloat16", causal), pass_, times, source)
                 for b, t, s, n, k, h, causal, pass_, times in rows)


_SWEEP_H100 = _points([
    # bench/dispatch.py on an H100 80GB HBM3 (jax 0.11.2, cuDNN 9.19), 2026-11-24, three runs (T1 S2/S8:
    # the first; T 1-4, S <= 32: the second; T 8-16, S 64-256 and the anchors: the third), in
    # docs/results/h100-2026-11-24.md. They replace the older points of the same shapes (`_newest`).
    (30720, 1, 2, 16, 16, 128, False, "fwd", {"cudnn": 4.9616, "small_seq": 0.3124, "xla": 0.3049}),
    (30720, 1, 2, 16, 16, 128, False, "fwd_bwd", {"cudnn": 20.914, "small_seq": 0.7008, "xla": 3.1959}),
    (30720, 1, 4, 16, 16, 128, False, "fwd", {"cudnn": 4.9618, "small_seq": 0.4851, "xla": 0.4794}),
    (30720, 1, 4, 16, 16, 128, False, "fwd_bwd", {"cudnn": 20.8441, "small_seq": 1.2345, "xla": 3.8761}),
    (30720, 1, 8, 16, 16, 128, False, "fwd", {"cudnn": 4.9898, "small_seq": 0.854, "xla": 0.8451}),
    (30720, 1, 8, 16, 16, 128, False, "fwd_bwd", {"cudnn": 21.1129, "small_seq": 2.2809, "xla": 5.5585}),
    (30720, 1, 16, 16, 4, 128, False, "fwd", {"cudnn": 1.3858, "small_seq": 1.1317, "xla": 1.2782}),
    (30720, 1, 16, 16, 4, 128, False, "fwd_bwd", {"cudnn": 19.0013, "small_seq": 2.5335, "xla": 2.9321}),
    (30720, 1, 16, 16, 16, 128, False, "fwd", {"cudnn": 4.9997, "small_seq": 1.5617, "xla": 1.5943}),
    (30720, 1, 16, 16, 16, 128, False, "fwd_bwd", {"cudnn": 21.4103, "small_seq": 4.393, "xla": 7.4536}),
    (15640, 1, 32, 16, 16, 128, False, "fwd", {"cudnn": 2.635, "small_seq": 1.5761, "xla": 1.6608}),
    (15640, 1, 32, 16, 16, 128, False, "fwd_bwd", {"cudnn": 11.8317, "small_seq": 4.8557, "xla": 6.6433}),
    (7820, 1, 64, 16, 16, 128, False, "fwd", {"cudnn": 1.7611, "xla": 1.5555}),
    (7820, 1, 64, 16, 16, 128, False, "fwd_bwd", {"cudnn": 7.2271, "xla": 6.5521}),
    (1955, 1, 256, 16, 16, 128, False, "fwd", {"cudnn": 1.3939, "xla": 1.4564}),
    (1955, 1, 256, 16, 16, 128, False, "fwd_bwd", {"cudnn": 4.5729, "xla": 6.4103}),
    (64, 1, 8192, 32, 8, 128, False, "fwd", {"cudnn": 0.7474, "xla": 2.4213}),
    (64, 1, 8192, 32, 8, 128, False, "fwd_bwd", {"cudnn": 9.057, "xla": 5.201}),
    (30720, 2, 4, 16, 16, 128, False, "fwd", {"cudnn": 10.2679, "small_seq": 0.6097, "xla": 3.2405}),
    (30720, 2, 4, 16, 16, 128, False, "fwd_bwd", {"cudnn": 26.7308, "small_seq": 1.4193, "xla": 7.6275}),
    (30720, 2, 16, 16, 16, 128, False, "fwd", {"cudnn": 10.4732, "small_seq": 1.8331, "xla": 5.6269}),
    (30720, 2, 16, 16, 16, 128, False, "fwd_bwd", {"cudnn": 26.9495, "small_seq": 4.3767, "xla": 12.1582}),
    (15640, 2, 32, 16, 16, 128, False, "fwd", {"cudnn": 5.238, "small_seq": 4.4688, "xla": 4.7615}),
    (15640, 2, 32, 16, 16, 128, False, "fwd_bwd", {"cudnn": 14.7512, "small_seq": 7.5559, "xla": 10.0956}),
    (7820, 2, 64, 16, 16, 128, False, "fwd", {"cudnn": 2.6715, "xla": 4.4675}),
    (7820, 2, 64, 16, 16, 128, False, "fwd_bwd", {"cudnn": 8.3227, "xla": 9.6145}),
    (1955, 2, 256, 16, 16, 128, False, "fwd", {"cudnn": 1.3955, "xla": 4.3734}),
    (1955, 2, 256, 16, 16, 128, False, "fwd_bwd", {"cudnn": 4.8448, "xla": 9.3995}),
    (30720, 4, 4, 16, 16, 128, False, "fwd", {"cudnn": 10.2334, "small_seq": 0.8069, "xla": 3.5389}),
    (30720, 4, 4, 16, 16, 128, False, "fwd_bwd", {"cudnn": 28.5691, "small_seq": 2.0163, "xla": 8.6355}),
    (30720, 4, 16, 16, 16, 128, False, "fwd", {"cudnn": 10.2937, "small_seq": 2.49, "xla": 6.388}),
    (30720, 4, 16, 16, 16, 128, False, "fwd_bwd", {"cudnn": 29.0233, "small_seq": 6.1205, "xla": 13.1411}),
    (15640, 4, 32, 16, 16, 128, False, "fwd", {"cudnn": 5.2949, "small_seq": 4.8731, "xla": 5.6069}),
    (15640, 4, 32, 16, 16, 128, False, "fwd_bwd", {"cudnn": 15.6203, "small_seq": 8.8459, "xla": 10.8298}),
    (7820, 4, 64, 16, 16, 128, False, "fwd", {"cudnn": 2.667, "xla": 4.9207}),
    (7820, 4, 64, 16, 16, 128, False, "fwd_bwd", {"cudnn": 8.8785, "xla": 10.1599}),
    (1955, 4, 256, 16, 16, 128, False, "fwd", {"cudnn": 1.4371, "xla": 4.5214}),
    (1955, 4, 256, 16, 16, 128, False, "fwd_bwd", {"cudnn": 5.2168, "xla": 9.797}),
    (30720, 8, 4, 16, 16, 128, False, "fwd", {"cudnn": 10.259, "xla": 5.3189}),
    (30720, 8, 4, 16, 16, 128, False, "fwd_bwd", {"cudnn": 30.5264, "xla": 10.407}),
    (30720, 8, 16, 16, 16, 128, False, "fwd", {"cudnn": 10.2034, "xla": 8.517}),
    (30720, 8, 16, 16, 16, 128, False, "fwd_bwd", {"cudnn": 31.6038, "xla": 15.3555}),
    (15640, 8, 32, 16, 16, 128, False, "fwd", {"cudnn": 5.3056, "xla": 7.4216}),
    (15640, 8, 32, 16, 16, 128, False, "fwd_bwd", {"cudnn": 16.6578, "xla": 12.5519}),
    (7820, 8, 64, 16, 16, 128, False, "fwd", {"cudnn": 2.6957, "xla": 5.4387}),
    (7820, 8, 64, 16, 16, 128, False, "fwd_bwd", {"cudnn": 9.5018, "xla": 11.2843}),
    (1955, 8, 256, 16, 16, 128, False, "fwd", {"cudnn": 1.5627, "xla": 4.8654}),
    (1955, 8, 256, 16, 16, 128, False, "fwd_bwd", {"cudnn": 5.5642, "xla": 10.3688}),
    (30720, 16, 4, 16, 16, 128, False, "fwd", {"cudnn": 10.1962, "xla": 5.8878}),
    (30720, 16, 4, 16, 16, 128, False, "fwd_bwd", {"cudnn": 33.7401, "xla": 13.0524}),
    (30720, 16, 16, 16, 16, 128, False, "fwd", {"cudnn": 10.208, "xla": 10.3926}),
    (30720, 16, 16, 16, 16, 128, False, "fwd_bwd", {"cudnn": 35.2786, "xla": 19.6295}),
    (15640, 16, 32, 16, 16, 128, False, "fwd", {"cudnn": 5.2927, "xla": 9.3353}),
    (15640, 16, 32, 16, 16, 128, False, "fwd_bwd", {"cudnn": 18.4224, "xla": 15.4757}),
    (7820, 16, 64, 16, 16, 128, False, "fwd", {"cudnn": 2.675, "xla": 6.0914}),
    (7820, 16, 64, 16, 16, 128, False, "fwd_bwd", {"cudnn": 10.5008, "xla": 13.1411}),
    (1955, 16, 256, 16, 16, 128, False, "fwd", {"cudnn": 1.519, "xla": 5.3152}),
    (1955, 16, 256, 16, 16, 128, False, "fwd_bwd", {"cudnn": 5.9652, "xla": 11.4835}),
    (64, 128, 128, 16, 16, 128, False, "fwd", {"cudnn": 0.0766, "xla": 0.305}),
    (64, 128, 128, 16, 16, 128, False, "fwd_bwd", {"cudnn": 0.3323, "xla": 0.6157}),
    (4, 4096, 4096, 16, 16, 128, True, "fwd", {"cudnn": 0.5171, "xla": 7.6361}),
    (4, 4096, 4096, 16, 16, 128, True, "fwd_bwd", {"cudnn": 2.0172, "xla": 16.078}),
], "bench/dispatch.py, H100, 2026-11-24")

_DESIGN_H100 = _points([
    # /work/shared/DESIGN.md "Facts measured on an H100 and on two H200s, 2026-11-23", and issue 14
    # (H100, implementation=None): sdpagraph's cuDNN graphs.
    (64, 1, 8192, 32, 8, 128, False, "fwd", {"cudnn": 0.705}),
    (30720, 1, 16, 16, 16, 128, False, "fwd", {"cudnn": 4.88}),
    (30720, 1, 16, 16, 16, 128, False, "fwd_bwd", {"cudnn": 21.5}),
    (30720, 1, 4, 16, 16, 128, False, "fwd", {"cudnn": 4.80}),
    (30720, 1, 4, 16, 16, 128, False, "fwd_bwd", {"cudnn": 20.9}),
], "DESIGN.md / issue 14, H100, 2026-11-23")

_DENSE_H100 = _points([
    # docs/results/attention-h100-2026-11-22.json (bench/attention.py on an H100, 2026-11-22):
    # sdpagraph's cuDNN graphs and its XLA backend on dense shapes (forward+backward: q, k, v grads).
    (4, 4096, 4096, 16, 16, 128, True, "fwd", {"cudnn": 0.4987, "xla": 7.5468}),
    (4, 4096, 4096, 16, 16, 128, True, "fwd_bwd", {"cudnn": 2.0671, "xla": 15.5029}),
    (4, 4096, 4096, 16, 16, 128, False, "fwd", {"cudnn": 0.8956, "xla": 7.4146}),
    (4, 4096, 4096, 16, 16, 128, False, "fwd_bwd", {"cudnn": 3.5437, "xla": 15.5035}),
    (8, 2048, 2048, 16, 16, 64, True, "fwd", {"cudnn": 0.1947, "xla": 3.7671}),
    (8, 2048, 2048, 16, 16, 64, True, "fwd_bwd", {"cudnn": 0.7971, "xla": 7.7216}),
    (1, 8192, 8192, 32, 8, 128, True, "fwd", {"cudnn": 0.9862, "xla": 21.8234}),
    (1, 8192, 8192, 32, 8, 128, True, "fwd_bwd", {"cudnn": 3.7782, "xla": 52.6519}),
], "docs/results/attention-h100-2026-11-22.json, H100, 2026-11-22")

_EXPLORE_H100 = _points([
    # An H100 80GB HBM3 (jax 0.11.2), 2026-11-23: the XLA backend and this small-sequence backend
    # (its formulation before the output-normalization epilogue), bf16, wall-clock medians of jitted
    # calls; forward+backward is jax.grad of sum(out * dO) for a random dO (q, k, v gradients).
    (30720, 1, 2, 16, 16, 128, False, "fwd", {"xla": 0.2843, "small_seq": 0.2774}),
    (30720, 1, 2, 16, 16, 128, False, "fwd_bwd", {"xla": 3.1636, "small_seq": 0.6626}),
    (30720, 1, 4, 16, 16, 128, False, "fwd", {"xla": 0.4546, "small_seq": 0.4587}),
    (30720, 1, 4, 16, 16, 128, False, "fwd_bwd", {"xla": 3.8042, "small_seq": 1.2048}),
    (30720, 1, 8, 16, 16, 128, False, "fwd", {"xla": 0.788, "small_seq": 0.8134}),
    (30720, 1, 8, 16, 16, 128, False, "fwd_bwd", {"xla": 5.481, "small_seq": 2.2424}),
    (30720, 1, 16, 16, 16, 128, False, "fwd", {"xla": 1.5699, "small_seq": 1.5245}),
    (30720, 1, 16, 16, 16, 128, False, "fwd_bwd", {"xla": 7.3645, "small_seq": 4.3305}),
    (30720, 1, 32, 16, 16, 128, False, "fwd", {"xla": 3.2029, "small_seq": 2.9957}),
    (30720, 1, 32, 16, 16, 128, False, "fwd_bwd", {"xla": 12.7969, "small_seq": 9.4505}),
    (30720, 2, 8, 16, 16, 128, False, "fwd", {"xla": 4.3952, "small_seq": 0.964}),
    (30720, 2, 8, 16, 16, 128, False, "fwd_bwd", {"xla": 10.0667, "small_seq": 2.4248}),
    (30720, 4, 16, 16, 16, 128, False, "fwd", {"xla": 6.3375, "small_seq": 2.4606}),
    (30720, 4, 16, 16, 16, 128, False, "fwd_bwd", {"xla": 13.0093, "small_seq": 6.0975}),
    (30720, 1, 16, 16, 4, 128, False, "fwd", {"xla": 1.2477, "small_seq": 1.1055}),
    (30720, 1, 16, 16, 4, 128, False, "fwd_bwd", {"xla": 2.9405, "small_seq": 2.5359}),
], "H100 exploration run, 2026-11-23")

def _newest(*groups: tuple[Point, ...]) -> tuple[Point, ...]:
    """The points of `groups` (newest group first), each shape and pass once: a shape measured
    again keeps only its newest point, so the table never holds two answers for one question."""
    seen, kept = set(), []
    for point in (p for group in groups for p in group):
        if (point.shape, point.pass_) not in seen:
            seen.add((point.shape, point.pass_))
            kept.append(point)
    return tuple(kept)


H100_TABLE = Table(
    gpu="NVIDIA H100 80GB HBM3",
    points=_newest(_SWEEP_H100, _DESIGN_H100, _DENSE_H100, _EXPLORE_H100),
    date="2026-11-24",
    source="H100 80GB HBM3. The sweep (T 1-16, S 2-256, GQA, decode and dense anchors: xla, small_seq, cudnn): bench/dispatch.py, "
           "2026-11-24; cuDNN small-sequence and decode: DESIGN.md and issue 14 (2026-11-23); dense "
           "cuDNN and XLA: docs/results/attention-h100-2026-11-22.json; XLA and small_seq small-sequence "
           "shapes: measured 2026-11-23. "
           "Refresh with `python bench/dispatch.py --write-table` on the GPU.",
)
