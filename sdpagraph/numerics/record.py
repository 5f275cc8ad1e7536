"""The numerical check's outcome: what one check found, whether that passes, the record kept in
each graph's cache entry, and the words people read about it. Everything that decides pass/fail
or puts errors into words uses this module.

    NumericsResult                            one check (`check.check_numerics` returns it)
    result.to_record() / read_record(meta)    the record written into / read back from entry metadata
    meta_update(record)                       the metadata update that stores a record
    over_tolerance(errors, tolerances)        the outputs that fail: above their bound, or not finite
    failure_reason(record, directions)        why a config whose graphs failed runs on XLA
    check_error_reason(error)                 why a config whose check could not run does
    format_error(value), errors_text(...)     errors in the short form tables and summaries use
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

# The entry metadata field holding the numerical check's record:
#   {"passed": bool, "errors": {output: relative error}, "tolerances": {output: bound},
#    "checked": unix time, "seed": int, "seconds": float, "slice": str, "training": bool,
#    "timings": {phase: seconds}}
# Only "passed", "errors", "tolerances", "seed" (and "detail", a reason some records carry in place
# of errors) are read back: a record missing the others still reads.
NUMERICS_FIELD = "numerics"
# A check that could not run is described in one line of at most this many characters.
ERROR_TEXT_CHARS = 300


@dataclass(frozen=True)
class NumericsResult:
    """One check: the relative errors per output, their bounds, and how it ran."""

    errors: dict[str, float]
    tolerances: dict[str, float]
    seconds: float
    seed: int
    slice: str  # "whole" or which batch rows and heads the reference ran on
    training: bool
    # run_s, reference_s; compiled: trace_s, compile_s; direct: device_s, device_mib
    timings: dict[str, float] = field(default_factory=dict)
    checked: float = field(default_factory=time.time)

    @property
    def passed(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        return over_tolerance(self.errors, self.tolerances)

    def summary(self) -> str:
        """'passed: o 3.1e-03, dq 4.0e-03, ...' or 'FAILED: o 3.1e-01 > 1e-02, ...'."""
        return ("passed" if self.passed else "FAILED") + ": " + errors_text(self.errors, self.tolerances)

    def to_record(self) -> dict[str, Any]:
        """The entry metadata record (`NUMERICS_FIELD`): msgpack-able plain data."""
        return {
            "passed": self.passed,
            "errors": {name: float(error) for name, error in self.errors.items()},
            "tolerances": dict(self.tolerances),
            "checked": self.checked,
            "seed": self.seed,
            "seconds": self.seconds,
            "slice": self.slice,
            "training": self.training,
            "timings": dict(self.timings),
        }


# ----------------------------------------------------------------------------- the record in an entry

def read_record(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The record in an entry's metadata, or None (never checked, or not a record)."""
    record = meta.get(NUMERICS_FIELD)
    return record if isinstance(record, Mapping) else None


def meta_update(record: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata fields to merge into an entry to store `record` (`GraphCache.update_meta`)."""
    return {NUMERICS_FIELD: dict(record)}


def record_passed(record: Mapping[str, Any]) -> bool:
    return bool(record.get("passed"))


# ----------------------------------------------------------------------------- pass/fail

def over_tolerance(errors: Mapping[str, float | None], tolerances: Mapping[str, float]) -> list[str]:
    """The outputs whose error is not finite (None: unknown, counts as inf) or above their bound."""
    return [name for name, error in errors.items() if _fails(_as_error(error), tolerances.get(name))]


def _fails(error: float, bound: float | None) -> bool:
    return not math.isfinite(error) or (bound is not None and error > float(bound))


def _as_error(error: float | None) -> float:
    return math.inf if error is None else float(error)


# ----------------------------------------------------------------------------- text

def format_error(value: float) -> str:
    """'3.1e-03', 'inf' or 'nan'."""
    return f"{value:.1e}" if math.isfinite(value) else str(value)


def errors_text(errors: Mapping[str, float], tolerances: Mapping[str, float] | None = None) -> str:
    """'o 3.1e-03, dq 4.0e-03'; given `tolerances`, a failing output shows its bound: 'o 3.1e-01 > 0.01'."""
    failing = set(over_tolerance(errors, tolerances)) if tolerances is not None else set()
    parts = []
    for name, error in errors.items():
        bound = None if tolerances is None else tolerances.get(name)
        parts.append(f"{name} {format_error(error)}" + (f" > {bound:g}" if name in failing and bound is not None
                                                          else ""))
    return ", ".join(parts)


def failure_reason(record: Mapping[str, Any], directions: tuple[str, ...] = ()) -> str:
    """Why the config's graphs are not used, from their failed record (`Support.reason`)."""
    what = "graphs" if len(directions) != 1 else "graph"
    errors, tolerances = record.get("errors") or {}, record.get("tolerances") or {}
    failures = [_failure_text(name, _as_error(errors[name]), tolerances.get(name))
                for name in over_tolerance(errors, tolerances)]
    failures = failures or [str(record.get("detail") or "the check did not pass")]
    return (f"cuDNN's {what} for this config computed wrong values on this GPU ({', '.join(failures)}; "
            f"checked against a float32 NumPy reference, seed {record.get('seed')}); the call runs on XLA")


def _failure_text(name: str, error: float, bound: float | None) -> str:
    """'o error 0.31 > 0.01'."""
    return f"{name} error {_number(error)}" + ("" if bound is None else f" > {_number(float(bound))}")


def _number(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if math.isinf(value) else f"{value:.3g}")


def error_text(error: BaseException) -> str:
    """'RuntimeError: out of memory while checking': an exception the check raised, in one short line."""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:ERROR_TEXT_CHARS]}"


def check_error_reason(error: BaseException) -> str:
    """Why the config's graphs are not used when their check raised `error` (`Support.reason`)."""
    return (f"the numerical check of cuDNN's graphs for this config could not run ({error_text(error)}), "
            "so they are not used; the call runs on XLA")
