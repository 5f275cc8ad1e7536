"""Which backend is fastest where: XLA, the small-sequence backend and cuDNN over small query and
key lengths at a large batch, packed small-sequence calls, and a few dense anchors; the data behind
`dispatch.rule`.

    python3 bench/dispatch.py --out DIR [--write-table PATH] [--quick] [--backends xla,small_seq,cudnn,jax_xla]
                              [--time-budget SECONDS] [--peak-tbs TBS] [--verify]

It uses the installed sdpagraph (`pip install .`: cuDNN runs through its executor), or this
checkout's when the installed one lacks the packed small-sequence backend.

Cases, in this order (the time budget cuts the last ones first): the small-sequence regime (N16 H128
bf16, T in {1, 2, 4} x S in {4, 16, 32}, B = 30720), packed calls with the `max_seqlen_q` /
`max_seqlen_kv` hints (self-attention rows of 1024 tokens in segments of 1-4 and of 4, cross-attention
of one query per segment over 16 keys), the crossover to cuDNN (T in {1, 2, 4, 8, 16} x S in {4, 16,
32, 64, 256}, the rest of that grid, nearest the regime first; B = 30720 scaled down so that K and V
together stay within 4.1 GB), then anchors: GQA (N16/K4), decode (B64 T1 S8192 N32/K8), dense (B4
T4096 causal, B64 T128). Forward (jit of the call; cuDNN's inference graph) and forward+backward (jit
of jax.grad of sum(out * dO) for a random dO, gradients of q, k and v), each backend called through
`sdpagraph.attention(..., implementation=...)`; `jax_xla` in --backends adds
`jax.nn.dot_product_attention(implementation="xla")` beside them (unpacked cases; a competitor, not in
the dispatch table). A case a backend cannot run (cuDNN declines, no GPU,
out of memory) is recorded with the error and the sweep goes on. Times: median over rounds of the
mean of back-to-back calls (`time_ms`). cuDNN's numerical check of new graphs is off
(`SDPAGRAPH_VERIFY=off`, it costs 1-2 s per shape and is measured by bench/numerics.py) unless
`--verify`.

Time: the H100 run of 2026-11-24 (docs/results/jnp-mods-dispatch-2026-11-24.md) spent 29 s per case,
most of it drawing the 4 GB of inputs with NumPy on the host; they are now drawn on the device, which
leaves compiles and cuDNN's graph builds: expected 5-12 s per case (not yet measured), 32 cases. The
default `--time-budget 200` starts no case after 200 s, so the run ends within about 4 minutes
whatever a case costs; cases not started are listed as cut (the anchors, then the crossover's far
corners), and `--time-budget 600` runs them all.

Prints one table and writes it to DIR/dispatch.md: each backend's time, the small-sequence forward's
achieved HBM bandwidth against the GPU's datasheet peak and a measured copy, the ratios small_seq/xla
and cudnn/xla, the measured best and what the rule picks (with the built-in table, with a table of
this run's points, and with the model fitted to this run alone, each with its time over the best);
and DIR/dispatch.json. `--write-table PATH` adds this GPU's measured points (not the packed cases,
whose shape classes the table does not key) to a table file that `SDPAGRAPH_DISPATCH_TABLE=PATH` (or
`dispatch_table.load_table`) reads; on an H100 the built-in table's times are kept where this run did not
time that backend for that shape class and pass. `--quick`: tiny shapes, to check the script end to end on any machine (a CPU included).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback
from typing import Any

import jax
import jax_timing  # bench/ is on sys.path when a script here runs
import jax.numpy as jnp
import numpy as np

try:  # the installed package (with its executor), when it has the packed small-sequence backend
    import sdpagraph.backends.small_seq.packed  # noqa: F401
except ImportError:  # not installed, or installed before it: this checkout's (cuDNN needs the executor)
    for name in [m for m in sys.modules if m == "sdpagraph" or m.startswith("sdpagraph.")]:
        del sys.modules[name]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sdpagraph
from sdpagraph.dispatch import rule as dispatch
from sdpagraph.dispatch import table as dispatch_table
from sdpagraph.call import prepare_call
from sdpagraph.backends.small_seq.backend import small_seq_reason

BACKENDS = ("xla", "small_seq", "cudnn")
# A competitor, not a backend: jax.nn.dot_product_attention(implementation="xla") on the same call
# (unpacked cases only); timed beside the backends, kept out of the dispatch table and the best pick.
JAX_XLA = "jax_xla"
KV_BUDGET_BYTES = 4.1e9  # K and V together, per case
FULL_B = 30720
# Datasheet HBM bandwidth (TB/s) by chip: H100 SXM5 80GB HBM3, H200 141GB HBM3e.
PEAK_TBS = {"H100": 3.35, "H200": 4.8}


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape. `packed`: None, or how the rows are packed: "self:L" (self-attention, segments of L
    tokens), "self:1-L" (of 1, 2, ..., L tokens in turn), "cross:Lq/Lkv" (the r-th query segment of Lq
    tokens attends to the r-th key segment of Lkv); the hints are the longest segments."""

    b: int
    t: int
    s: int
    n: int = 16
    k: int = 16
    h: int = 128
    causal: bool = False
    packed: str | None = None

    def hints(self) -> dict:
        if self.packed is None:
            return {}
        kind, lengths = self.packed.split(":")
        if kind == "cross":
            q, kv = (int(x) for x in lengths.split("/"))
            return {"max_seqlen_q": q, "max_seqlen_kv": kv}
        return {"max_seqlen_q": int(lengths.split("-")[-1])}

    def segment_ids(self) -> Any:
        """The packed ids (jax arrays), None for BSHD."""
        if self.packed is None:
            return None
        kind, lengths = self.packed.split(":")
        if kind == "cross":
            q, kv = (int(x) for x in lengths.split("/"))
            return _ids(self.b, self.t, [q]), _ids(self.b, self.s, [kv])
        longest = int(lengths.split("-")[-1])
        return _ids(self.b, self.t, list(range(1, longest + 1)) if "-" in lengths else [longest])

    def spec(self):
        structs = [jax.ShapeDtypeStruct(x, jnp.bfloat16) for x in
                   ((self.b, self.t, self.n, self.h), (self.b, self.s, self.k, self.h), (self.b, self.s, self.k, self.h))]
        ids = self.segment_ids()
        return prepare_call(*structs, is_causal=self.causal, segment_ids=ids, **self.hints()).spec

    def label(self) -> str:
        shape = dispatch_table.Shape(self.b, self.t, self.s, self.n, self.k, self.h, self.h, "bfloat16", self.causal)
        return shape.summary() + (f" packed {self.packed}" if self.packed else "")


def _ids(rows: int, length: int, cycle: list[int]) -> Any:
    """(rows, length) int32: consecutive segments whose lengths cycle through `cycle` (ids 1, 2, ...)."""
    row, number, i = np.zeros(length, np.int32), 0, 0
    while i < length:
        size = cycle[number % len(cycle)]
        number += 1
        row[i:i + size] = number
        i += size
    return jnp.asarray(np.tile(row, (rows, 1)))


def sweep_cases(quick: bool) -> list[Case]:
    """The small-sequence regime first, then packed calls, the crossover, the anchors."""
    if quick:
        return ([Case(8, t, s, 4, 2, 32) for t in (1, 2) for s in (2, 16, 64)] + [Case(2, 64, 64, 4, 4, 32, True)]
                + [Case(2, 16, 16, 4, 2, 32, packed="self:1-4"), Case(2, 8, 32, 4, 2, 32, packed="cross:1/4")])
    grid = []
    for t in (1, 2, 4, 8, 16):
        for s in (4, 16, 32, 64, 256):
            b = min(FULL_B, int(KV_BUDGET_BYTES // (2 * s * 16 * 128 * 2)))
            grid.append(Case(b, t, s))
    regime = [c for c in grid if small_seq_reason(c.spec()) is None]
    crossover = sorted((c for c in grid if c not in regime), key=lambda c: (c.t / 4) * (c.s / 32))
    packed = [Case(120, 1024, 1024, packed="self:1-4"), Case(120, 1024, 1024, packed="self:4"),
              Case(8, 1024, 16384, packed="cross:1/16")]
    anchors = [
        Case(FULL_B, 1, 16, 16, 4),  # GQA
        Case(64, 1, 8192, 32, 8),  # decode
        Case(4, 4096, 4096, causal=True),  # dense training
        Case(64, 128, 128),
    ]
    return regime + packed + crossover + anchors


def time_ms(fn, *args, repeats=5, rounds=3):
    return jax_timing.time_ms(fn, *args, repeats=repeats, rounds=rounds)


def measure(backend: str, case: Case, pass_: str, arrays) -> float:
    q, k, v, d_out = arrays
    extra = {"training": pass_ == "fwd_bwd"} if backend == "cudnn" else {}
    ids = case.segment_ids()

    def attn(q, k, v):
        if backend == JAX_XLA:
            return jax.nn.dot_product_attention(q, k, v, is_causal=case.causal, implementation="xla")
        return sdpagraph.attention(q, k, v, is_causal=case.causal, segment_ids=ids, implementation=backend,
                                   **case.hints(), **extra)

    if pass_ == "fwd":
        return time_ms(jax.jit(attn), q, k, v)
    loss = lambda q, k, v, d: jnp.sum(attn(q, k, v).astype(jnp.float32) * d.astype(jnp.float32))  # noqa: E731
    return time_ms(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, d_out)


def copy_tbs(quick: bool) -> float | None:
    """Bytes read + written per second by a jitted elementwise op over 1 GiB of bf16 (a practical peak)."""
    x = jnp.ones((2 ** (16 if quick else 29),), jnp.bfloat16)
    try:
        ms = time_ms(jax.jit(lambda x: x * 2), x, repeats=10)
    finally:
        del x
    return 2 * 2 * 2 ** (16 if quick else 29) / ms / 1e9


def peak_tbs(gpu: str | None, override: float | None) -> float | None:
    if override:
        return override
    chip = dispatch_table._chip(gpu or "")
    return PEAK_TBS.get(chip or "")


def run(args) -> dict:
    gpu = dispatch_table.current_gpu()
    device = jax.devices()[0]
    backends = [b for b in args.backends.split(",") if b]
    result = {"device": device.device_kind, "gpu": gpu, "platform": device.platform, "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "quick": args.quick, "rows": []}
    try:
        result["copy_tbs"] = copy_tbs(args.quick)
    except Exception as error:  # noqa: BLE001
        result["copy_tbs"] = None
        print(f"copy timing failed: {error}", file=sys.stderr)
    result["peak_tbs"] = peak_tbs(gpu, args.peak_tbs)
    print(f"{device.device_kind} ({device.platform}), jax {jax.__version__}; copy {result['copy_tbs']} TB/s, "
          f"datasheet peak {result['peak_tbs']} TB/s", flush=True)
    started = time.perf_counter()
    cases = sweep_cases(args.quick)[args.skip:]
    for case in cases:
        if time.perf_counter() - started > args.time_budget:
            rest = cases[cases.index(case):]
            result["cut"] = (f"stopped after {args.time_budget:.0f} s (--time-budget); not run: "
                             + "; ".join(c.label() for c in rest))
            print(result["cut"], file=sys.stderr)
            break
        spec = case.spec()
        in_regime = small_seq_reason(spec) is None
        try:  # drawn on the device: NumPy's generator took ~20 s per case for the 4 GB of K and V
            shapes = ((case.b, case.t, case.n, case.h), (case.b, case.s, case.k, case.h),
                      (case.b, case.s, case.k, case.h), (case.b, case.t, case.n, case.h))
            arrays = [jax.random.normal(key, shape, jnp.bfloat16)
                      for key, shape in zip(jax.random.split(jax.random.key(0), len(shapes)), shapes)]
        except Exception as error:  # noqa: BLE001
            print(f"{case.label()}: could not make inputs: {error}", file=sys.stderr)
            continue
        for pass_ in dispatch_table.PASSES:
            row = {"case": dataclasses.asdict(case), "label": case.label(), "pass": pass_, "ms": {}, "errors": {}}
            for backend in backends:
                if backend == "small_seq" and not in_regime:
                    row["errors"][backend] = small_seq_reason(spec)
                    continue
                if backend == JAX_XLA and case.packed is not None:
                    continue  # jax's call takes no packed segments with these hints
                try:
                    row["ms"][backend] = measure(backend, case, pass_, arrays)
                except Exception as error:  # noqa: BLE001 - record it and go on
                    row["errors"][backend] = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
                    if args.verbose:
                        traceback.print_exc()
            io = dispatch_table.features(dispatch_table.Shape.of(spec), "xla", "fwd")[1] * 1e9
            if pass_ == "fwd" and "small_seq" in row["ms"]:
                row["small_seq_tbs"] = io / row["ms"]["small_seq"] / 1e9
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        del arrays
    result["seconds"] = time.perf_counter() - started
    return result


def _backend_ms(row: dict) -> dict[str, float]:
    """The row's times of sdpagraph's backends (not the competitor's)."""
    return {name: ms for name, ms in row["ms"].items() if name in BACKENDS}


def table_from_run(result: dict) -> dispatch_table.Table:
    points = [dispatch_table.Point(dispatch_table.Shape.of(Case(**r["case"]).spec()), r["pass"], _backend_ms(r),
                                   "bench/dispatch.py")
              for r in result["rows"] if _backend_ms(r) and r["case"]["packed"] is None]
    return dispatch_table.Table(result["gpu"] or result["device"], tuple(points), result["date"],
                          f"bench/dispatch.py on {result['device']}, jax {result['jax']}, {result['date']}")


def with_builtin(table: dispatch_table.Table) -> dispatch_table.Table:
    """This run's points plus the built-in table's (same chip) for what this run did not measure: a
    built-in time is dropped where this run timed that backend for the same shape class and pass."""
    builtin = dispatch_table.match_table(dispatch_table.builtin_tables(), table.gpu)
    measured = {(p.shape.class_key(), p.pass_, name) for p in table.points for name in p.times}
    kept = []
    for p in (builtin.points if builtin is not None else ()):
        times = {name: ms for name, ms in p.times.items() if (p.shape.class_key(), p.pass_, name) not in measured}
        if times:
            kept.append(dispatch_table.Point(p.shape, p.pass_, times, p.source))
    source = table.source + (f"; {len(kept)} points of the built-in table kept" if kept else "")
    return dispatch_table.Table(table.gpu, table.points + tuple(kept), table.date, source)


def decide(result: dict, fitted: dispatch_table.Table) -> None:
    """Add each row's measured best and the rule's picks (built-in table, this run's table)."""
    builtin, note = (dispatch._default_table(result["gpu"], "") if result["gpu"]
                     else (dispatch_table.stand_in_table(), ""))
    for row in result["rows"]:
        spec = Case(**row["case"]).spec()
        candidates = {"xla": True, "small_seq": small_seq_reason(spec) is None, "cudnn": "cudnn" in row["ms"]}
        ms = _backend_ms(row)
        if ms:
            row["best"] = min(ms, key=ms.get)
        model_only = dataclasses.replace(fitted, use_measured=False, _models={})
        for label, table in (("rule_builtin", builtin), ("rule_this_run", fitted), ("model_this_run", model_only)):
            choice = dispatch.choose(spec, candidates, table, training=row["pass"] == "fwd_bwd",
                                     use_default_table=False)
            row[label] = choice.backend
            if ms and choice.backend in ms:
                row[label + "_vs_best"] = ms[choice.backend] / ms[row["best"]]


def fmt(x, digits=3):
    return "" if x is None else f"{x:.{digits}g}"


def _outside(small_seq_error: str) -> bool:
    """Whether small_seq's entry says the case is outside its regime (not an error)."""
    return "limit" in small_seq_error or "hints" in small_seq_error


def markdown(result: dict) -> str:
    peak, copy = result.get("peak_tbs"), result.get("copy_tbs")
    lines = [
        f"# Backend speed by shape: {result['device']} ({result['platform']}), jax {result['jax']}, {result['date']}",
        "",
        f"`python3 bench/dispatch.py{' --quick' if result['quick'] else ''}`; bf16; ms per call (median of "
        "rounds of back-to-back calls); fwd+bwd = jax.grad of sum(out * dO) w.r.t. q, k, v. HBM: the small-"
        f"sequence forward's Q+K+V+O bytes per second, against the datasheet peak ({fmt(peak)} TB/s) and a "
        f"jitted copy ({fmt(copy)} TB/s read+write). Rule: what `dispatch.choose` picks with the built-in "
        "table, with a table of this run's points (its measurements decide), and with the cost model fitted "
        "to this run alone (no measured point used; x: the pick's time over the best measured). jax xla (when "
        "asked for): `jax.nn.dot_product_attention(implementation=\"xla\")`, jitted with the same arguments, "
        "a competitor kept out of best and the rule.",
        "",
        "| shape | pass | xla | small_seq | cudnn | jax xla | small_seq TB/s | % peak | % copy | small_seq/xla | cudnn/xla | jax xla/small_seq | best | rule (built-in) | rule (this run) | model alone (this run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        ms, errors = row["ms"], row["errors"]

        def cell(name):
            if name in ms:
                return fmt(ms[name])
            return "n/a" if name == "small_seq" and _outside(errors.get(name, "")) else ("err" if name in errors else "")

        def over_xla(name):
            return fmt(ms[name] / ms["xla"]) if name in ms and "xla" in ms else ""
        tbs = row.get("small_seq_tbs")
        rules = []
        for label in ("rule_builtin", "rule_this_run", "model_this_run"):
            vs = row.get(label + "_vs_best")
            rules.append(f"{row.get(label, '')}" + (f" ({vs:.2f}x)" if vs is not None else ""))
        lines.append(
            f"| {row['label']} | {row['pass']} | {cell('xla')} | {cell('small_seq')} | {cell('cudnn')} | "
            f"{cell(JAX_XLA)} | {fmt(tbs)} | {fmt(100 * tbs / peak if tbs and peak else None)} | "
            f"{fmt(100 * tbs / copy if tbs and copy else None)} | {over_xla('small_seq')} | {over_xla('cudnn')} | "
            f"{fmt(ms[JAX_XLA] / ms['small_seq']) if JAX_XLA in ms and 'small_seq' in ms else ''} | "
            f"{row.get('best', '')} | "
            f"{rules[0]} | {rules[1]} | {rules[2]} |")
    errors: dict[str, int] = {}
    for row in result["rows"]:
        for name, msg in row["errors"].items():
            if not (name == "small_seq" and _outside(msg)):
                key = f"{name}: {msg.rsplit(': ', 1)[-1]}"  # the cause, without the shape
                errors[key] = errors.get(key, 0) + 1
    if errors:
        lines += ["", "Errors (cause: cases):", ""] + [f"- {e}: {n}" for e, n in sorted(errors.items())[:40]]
    lines += ["", f"Sweep time: {result.get('seconds', 0):.0f} s." + (f" {result['cut']}." if result.get("cut") else "")]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-dispatch", help="folder for dispatch.md and dispatch.json")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: check the script end to end")
    parser.add_argument("--write-table", metavar="PATH", help="add this GPU's points to a dispatch table file")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, default all")
    parser.add_argument("--peak-tbs", type=float, help="HBM peak to report against (default: datasheet by GPU)")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failed cases")
    parser.add_argument("--time-budget", type=float, default=200.0,
                        help="start no new case after this many seconds (default 200); the rest is reported as cut")
    parser.add_argument("--skip", type=int, default=0, metavar="N",
                        help="start after the first N cases (to go on with a sweep a time budget cut)")
    parser.add_argument("--verify", action="store_true",
                        help="keep cuDNN's numerical check of new graphs on (SDPAGRAPH_VERIFY=build)")
    args = parser.parse_args(argv)

    os.makedirs(args.out, exist_ok=True)
    if not args.verify:  # speed only: the check is measured by bench/numerics.py
        os.environ["SDPAGRAPH_VERIFY"] = "off"
    result = run(args)
    fitted = with_builtin(table_from_run(result))
    decide(result, fitted)
    text = markdown(result)
    print(text)
    with open(os.path.join(args.out, "dispatch.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "dispatch.json"), "w") as f:
        json.dump(result, f, indent=1)
    if args.write_table:
        tables = dispatch_table.tables_from_json(args.write_table) if os.path.exists(args.write_table) else {}
        tables[fitted.gpu] = fitted
        dispatch_table.tables_to_json(tables, args.write_table)
        print(f"wrote the {fitted.gpu} table ({len(fitted.points)} points) to {args.write_table}")


if __name__ == "__main__":
    main()
