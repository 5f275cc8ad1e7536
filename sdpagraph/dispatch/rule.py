"""Which backend runs an attention call: the fastest one that can, by measurement.

A backend that can run a call is not necessarily a good choice: on an H100, cuDNN builds the graphs
of B30720 T1 S16 N16 H128 and runs them 3.3x (forward) / 3.6x (forward+backward) slower than plain
XLA, 11x / 9x at S4 (docs/results/h100-2026-11-24.md). So `attention` asks this module, with the
backends that can run the call, which one to use.

The rule (`choose`):

1. `implementation=<a backend's name>` (`backends.registry`) forces that backend (ValueError with its
   reason when it cannot run the call). `implementation=None` chooses:
2. Among the candidates that can run the call, predict each one's time for the call's pass ("fwd"
   for a call that is not differentiated, `training=False`; "fwd_bwd" otherwise) and take the smallest.
3. A prediction is a measurement when the calibration table holds one of this shape class: the same
   T, S, N, K, H, H_v, dtype and causal flag, no other masks, bias or score_mod, and a batch within a
   factor `dispatch_table.MEASURED_BATCH_RANGE` of the measured one; the measured time is scaled
   linearly in B (the nearest measured batch is used). Otherwise it is the backend's cost model, fitted to all the
   table's measurements of that backend and pass (`dispatch_table`: its features, the fit).
   A model ranks only inside the region its fit was measured in (MODEL_MAX_Q_LEN, MODEL_MAX_KV_LEN);
   elsewhere only measurements rank, so an extrapolation never displaces cuDNN. A packed call with
   `max_seqlen_q` / `max_seqlen_kv` hints is predicted, for cuDNN and small_seq, as the sequences its
   hints bound (`Shape.of`), and for XLA as the dense (B, T, S) it computes.
4. A candidate with no measurement and no (trusted) model (the table has no data for that backend and
   pass) gets no prediction and ranks after every predicted one; among those, the registry's preference
   order decides (cuDNN when it can run the call, else XLA). Ties too.
5. A candidate may be given lazily (a callable returning its answer): it is asked only when it is
   the fastest predicted of those not yet ruled out, so a call where cuDNN is predicted slower never
   builds cuDNN graphs to find out whether cuDNN could run it.

The table (`dispatch.table.Table`): measured points for one GPU type. Built in: one per GPU type in
`dispatch/data/*.json` (dated and sourced). `SDPAGRAPH_DISPATCH_TABLE=path.json` (written by `python
bench/dispatch.py --write-table path.json` on the GPU) adds or replaces tables by GPU name
(`jax.Device.device_kind`). A GPU with no table uses the H100 one (and the reason says so); a machine
without a GPU uses no table (cuDNN does not run there, and the XLA backend, the reference, runs the call).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

from sdpagraph.backends import registry
from sdpagraph.config import DISPATCH_TABLE
from sdpagraph.dispatch.table import (Shape, Table, builtin_tables, current_gpu, match_table, stand_in_table,
                                      tables_from_json)
from sdpagraph.spec import AttentionSpec

# Where the cost models are trusted to rank backends: the region their fits were measured in (the
# small-sequence sweep). Elsewhere a model-only prediction does not rank: measured points do, then
# the registry's preference order (cuDNN when it runs the call).
MODEL_MAX_Q_LEN = 4
MODEL_MAX_KV_LEN = 32


# ----------------------------------------------------------------------------- the default table

@functools.lru_cache(maxsize=8)
def _default_table(gpu: str | None, env_path: str) -> tuple[Table | None, str]:
    if gpu is None:
        return None, "no GPU: no calibration table"
    tables = dict(builtin_tables())
    if env_path:
        tables.update(tables_from_json(env_path))
    found = match_table(tables, gpu)
    if found is not None:
        return found, ""
    stand_in = stand_in_table()
    return stand_in, f"no table for {gpu}; using the {stand_in.gpu} one"


def default_table() -> tuple[Table | None, str]:
    """(the table for this process's GPU, a note when it is a stand-in), `SDPAGRAPH_DISPATCH_TABLE` first."""
    return _default_table(current_gpu(), DISPATCH_TABLE.get())


# ----------------------------------------------------------------------------- the rule

def _packs_by_hints(name: str) -> bool:
    """Whether backend `name` computes a hinted packed call as the sequences its hints bound."""
    try:
        return registry.get(name).packs_by_hints
    except ValueError:  # a candidate only a test names
        return False


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
        computed = Shape.of(spec, has_score_mod, _packs_by_hints(name))  # a packed call's differs by backend
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

    # The fastest predicted first (ties and unpredicted ones in the candidates' order, the preference
    # order); ask lazy candidates in that order until one runs the call.
    preference = answers.names()
    order = sorted(numbers, key=lambda name: (numbers[name] is None, numbers[name] or 0.0, preference.index(name)))
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
                  f"{', '.join(preference)}{notes}")
        return Choice(best, reason, {n: numbers[n] for n in runnable}, pass_)
    unknown = [name for name in runnable if numbers[name] is None]
    if unknown:
        notes += f"; no data for {', '.join(unknown)}"
    reason = (f"{best} is the fastest predicted for {shape.summary()} {what} on {table_name}: "
              f"{listing(runnable)}{notes}")
    return Choice(best, reason, {n: numbers[n] for n in runnable}, pass_)
