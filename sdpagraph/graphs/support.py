"""The answer to "will this config run on cuDNN here, and if not, why?".

The answer comes from building the graphs the runtime would use (`answer_from_builds`);
the cache layer (`graph_store.check_graphs`) runs it through the cache and remembers it.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Callable

from sdpagraph.errors import Unsupported
from sdpagraph.graphs.builder import GraphBuildError
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.graphs.binning import bin_plan, waits_for_hint
from sdpagraph.graphs.operands import folds_segments
from sdpagraph.spec import AttentionSpec, directions_for

@dataclass(frozen=True)
class Support:
    """`supported`: cuDNN runs this config. `backend`: what `attention` will use (empty in an answer
    about cuDNN's graphs alone, `graph_answer`). `reason`: why."""

    supported: bool
    backend: str
    reason: str

    def __bool__(self) -> bool:
        return self.supported


def graph_answer(supported: bool, reason: str) -> Support:
    """An answer about cuDNN's graphs alone; which backend then runs the call is for the backend layer
    to name (`backends.cudnn`), so `backend` is left empty here."""
    return Support(supported, "", reason)


def environment_reason() -> str | None:
    """Why cuDNN cannot be used in this process at all, or None when it can be tried."""
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        return "no GPU visible to JAX (jax.devices('gpu') is empty)"
    if importlib.util.find_spec("cudnn") is None:  # not imported: a cache hit never needs it
        return "cudnn frontend not installed (pip install 'sdpagraph[cuda]')"
    return None


def answer_from_builds(spec: AttentionSpec, ir: ScoreModIR | None, training: bool,
                       build: Callable[[str], object],
                       passthrough: tuple[type[BaseException], ...] = ()) -> tuple[Support, bool]:
    """Whether cuDNN builds the graphs `attention` would run for (spec, ir), and whether that
    answer stays true for the life of this process.

    `build(direction)` builds (or finds) one graph the way the runtime does: forward and
    backward when `training`, else inference. The errors in `passthrough` (a strict cache's
    miss) propagate; every other failure becomes a "no" with the reason.
    """
    reason = environment_reason()
    if reason is not None:
        return graph_answer(False, reason), True
    directions = directions_for(training, spec)
    try:
        for direction in directions:
            build(direction)
    except passthrough:
        raise
    except Unsupported as error:
        return graph_answer(False, str(error)), True
    except GraphBuildError as error:
        return graph_answer(False, condense_reason(spec, error)), True
    except Exception as error:  # noqa: BLE001 - the query must answer, whatever went wrong
        return graph_answer(False, f"building the cuDNN graph failed unexpectedly: {type(error).__name__}: "
                       f"{' '.join(str(error).split())[:300]}"), False
    what = "forward and backward graphs" if training else "inference graph"
    how = _DENSE_SEGMENTS if folds_segments(spec, ir) else ""
    bins = bin_plan(spec, ir)
    if bins is not None:
        how += _BINS.format(bins=bins.bins, rows=bins.rows)
        if spec.max_seqlen_kv is None:
            how += _BINS_HINT
    elif waits_for_hint(spec, ir):
        how += _BINS_WAIT_FOR_HINT.format(most=spec.max_segments)
    return graph_answer(True, f"cuDNN builds the {what}{how}"), True


# What a supported answer adds when packed segments run on the dense twin (`operands.graph_spec`).
_DENSE_SEGMENTS = (" (packed segments on the dense layout, masked by segment bounds: memory stays O(T), "
                   "and the tiles between segments are computed and masked rather than skipped)")


# And when its documents move into bins (`graphs.binning`).
_BINS = ("; on one device (one GPU, or inside a shard_map), the documents move into {bins} bins of {rows} "
         "tokens, longest first, and only the tiles within a bin are computed (documents that need more bins, "
         "or are longer than a bin, run on the whole rows)")
_BINS_WAIT_FOR_HINT = ("; with max_segments_per_seq={most} and no max_seqlen_kv no bins are planned: pass "
                       "max_seqlen_kv=<the longest document> to move the documents into bins of that length "
                       "(where only the tiles within a bin are computed) when it is short enough to pay")
_BINS_HINT = ("; the bins are sized for documents up to a quarter of a row: pass max_seqlen_kv=<the longest "
              "document> to size them for yours")


def condense_reason(spec: AttentionSpec, error: GraphBuildError) -> str:
    """cuDNN's decline as one actionable sentence about this spec."""
    for pattern, explain in _KNOWN_DECLINES:
        if re.search(pattern, error.message, re.IGNORECASE):
            sentence = explain(spec, error)
            if sentence:
                return sentence
    first = re.split(r"(?<=[.;])\s", error.message, maxsplit=1)[0]
    return f"cuDNN {error.cudnn_version} declined the {error.direction} graph: {first[:240]}"


def _head_dim_reason(spec: AttentionSpec, error: GraphBuildError) -> str | None:
    for name, dim in (("head dim", spec.head_dim), ("value head dim", spec.head_dim_v)):
        if dim % 8:
            return f"{name} {dim} is not a multiple of 8"
    largest = max(spec.head_dim, spec.head_dim_v)
    if spec.head_dim != spec.head_dim_v and largest > 128:
        return (f"head dims {spec.head_dim}/{spec.head_dim_v} differ and exceed 128, which cuDNN "
                f"{error.cudnn_version} does not support on this GPU")
    if largest > 128:
        return f"head dim {largest} is above what cuDNN {error.cudnn_version} supports for this graph on this GPU"
    return None


_KNOWN_DECLINES = (
    (r"hidden_dim", _head_dim_reason),
    (r"Ragged offsets are only supported with padding mask",
     lambda spec, error: f"packed segments cannot be combined with a score_mod, chunk_size or mask on cuDNN "
                         f"{error.cudnn_version}: a score_mod turns off the padding mask packed sequences need"),
    (r"max_s_q > max_s_kv|max_s_q <= max_s_kv",
     lambda spec, error: f"cuDNN {error.cudnn_version} needs T <= S for bottom-right causal masks and sliding "
                         f"windows without sequence lengths (T={spec.q_len}, S={spec.kv_len})"),
    (r"Bottom right causal mask is only supported with is_bias=False",
     lambda spec, error: f"cuDNN {error.cudnn_version} cannot combine a bottom-right causal mask with a bias"),
    (r"only Python \(CuTeDSL\) engines", lambda spec, error: error.message.split(" (")[0]),
    (r"No valid engine configs",
     lambda spec, error: f"cuDNN {error.cudnn_version} has no engine for the {error.direction} graph of this config"),
)
