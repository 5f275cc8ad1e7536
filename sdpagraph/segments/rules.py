"""What packed `segment_ids` must satisfy, checked on concrete ids (NumPy) when a call is made: at
most `max_segments_per_seq` segments per row, and no segment longer than the `max_seqlen_q` /
`max_seqlen_kv` hints. The error texts are shared with the run-time checks of traced ids
(`segments.metadata`); `SDPAGRAPH_CHECK_SEGMENTS=off` switches both off. Shared by all layers, as
`spec` (which validates the arguments with these).

A segment is a maximal run of one nonzero id (`segments.metadata`); 0 is padding.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from sdpagraph.config import CHECK_SEGMENTS, OFF_WORDS


def _run_starts(ids: np.ndarray) -> np.ndarray:
    """(B, T) bool: where a segment (a maximal run of one nonzero id, `segments.metadata`) begins."""
    previous = np.concatenate([np.zeros_like(ids[:, :1]), ids[:, :-1]], axis=1)
    return (ids != 0) & (ids != previous)


def segment_counts(ids: np.ndarray) -> np.ndarray:
    """(B,) segments per row of concrete ids."""
    return np.sum(_run_starts(np.asarray(ids)), axis=1)


def segment_check_mode() -> str:
    """How ids that break `max_segments_per_seq` or a `max_seqlen_q` / `max_seqlen_kv` hint are met
    (SDPAGRAPH_CHECK_SEGMENTS, read when a call is made or traced): concrete ids raise when the call
    is made unless "off"; traced ids give their batch rows NaN ("nan", on the device, no host round
    trip), raise when the call runs ("raise", a host callback), or pass ("off": segments past the
    bound are dropped, their query rows give 0, and the small-sequence backend drops a segment's keys
    past `max_seqlen_kv`)."""
    raw = (CHECK_SEGMENTS.raw() or "").strip().lower()
    if raw in OFF_WORDS:  # the switch's old words: off
        return "off"
    if raw in ("1", "true", "on", "yes"):  # and on: the default check
        return CHECK_SEGMENTS.default
    return CHECK_SEGMENTS.get()


def segment_checks_enabled() -> bool:
    """Whether packed ids are checked at all (`segment_check_mode` is not "off")."""
    return segment_check_mode() != "off"


def segment_overflow_message(argname: str, row: int, count: int, bound: int) -> str:
    """The one error text for a row with more segments than `max_segments_per_seq`."""
    return (f"{argname}: row {row} has {count} segments, more than max_segments_per_seq={bound}; "
            f"segments past the bound would be dropped: pass max_segments_per_seq >= {count}")


def longest_segments(ids: np.ndarray) -> np.ndarray:
    """(B,) the longest segment of each row of concrete ids (maximal runs of one nonzero id), 0 for a
    row of padding."""
    ids = np.asarray(ids)
    index = np.arange(ids.shape[1])
    run_start = np.maximum.accumulate(np.where(_run_starts(ids), index, 0), axis=1)
    return np.max(np.where(ids != 0, index - run_start + 1, 0), axis=1, initial=0)


def segment_length_message(argname: str, hint_name: str, row: int, length: int, bound: int) -> str:
    """The one error text for a packed segment longer than its `max_seqlen_q` / `max_seqlen_kv` hint."""
    return (f"{argname}: row {row} has a segment of {length} tokens, longer than {hint_name}={bound}; the "
            f"small-sequence backend would drop its tokens past {bound}: pass {hint_name} >= {length}")


def seqlen_hint_checks(segment_ids: Any, max_seqlen_q: int | None,
                       max_seqlen_kv: int | None) -> list[tuple[str, Any, str, int]]:
    """What the hints promise about the ids: (ids' argument name, ids, hint's name, bound) per check.

    Self-attention (one ids array): a segment has as many keys as queries, so the smaller hint given
    bounds both; cross-attention: `max_seqlen_q` bounds the query ids, `max_seqlen_kv` the key ids."""
    if isinstance(segment_ids, (tuple, list)):
        pairs = (("segment_ids[0]", segment_ids[0], "max_seqlen_q", max_seqlen_q),
                 ("segment_ids[1]", segment_ids[1], "max_seqlen_kv", max_seqlen_kv))
        return [(arg, ids, hint, bound) for arg, ids, hint, bound in pairs if bound is not None]
    given = [(bound, hint) for hint, bound in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv))
             if bound is not None]
    return [("segment_ids", segment_ids, min(given)[1], min(given)[0])] if given else []


def _raise_first_over(per_row: np.ndarray, bound: int, message: Callable[[int, int], str]) -> None:
    over = np.flatnonzero(per_row > bound)
    if over.size:
        row = int(over[0])
        raise ValueError(message(row, int(per_row[row])))


def check_segment_count(argname: str, values: np.ndarray | None, bound: int | None) -> None:
    """ValueError when a row of concrete ids (`values`; None: traced, not checked here) has more than
    `bound` (`max_segments_per_seq`) segments."""
    if values is None or bound is None or not values.size or not segment_checks_enabled():
        return
    _raise_first_over(segment_counts(values), bound,
                      lambda row, count: segment_overflow_message(argname, row, count, bound))


def check_segment_lengths(argname: str, values: np.ndarray | None, hint_name: str, bound: int) -> None:
    """ValueError when a segment of concrete ids (`values`; None: traced, not checked here) is longer
    than `bound`, the hint `hint_name`."""
    if values is None or not values.size or not segment_checks_enabled():
        return
    _raise_first_over(longest_segments(values), bound,
                      lambda row, length: segment_length_message(argname, hint_name, row, length, bound))
