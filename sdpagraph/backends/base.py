"""The contract every backend keeps: a name, whether (and why not) it can run a call, and how it runs it.

    backend.support(spec, score_mod, training=..., verify=...) -> Support   can it run this call here?
    backend.attention(spec, q, k, v, inputs, score_mod, training=..., verify=...) -> (out, lse)
    backend.attention_with_sinks(spec, q, k, v, inputs, score_mod, sinks, verify=...) -> (out, lse)
    backend.fp8_attention(spec, q8, k8, v8, inputs, verify=...) -> (out8, amax)   FP8 specs, where supported

Every backend computes the same function (`sdpagraph.attention`'s docstring; the masks are
`backends.masking`'s): `out` is (B, T, N, H_v) in the input dtype and `lse` the logsumexp (B, N, T)
in float32, or None where the backend ran an inference graph that keeps no softmax statistics.
Backends are found through `backends.registry`, never by importing one another; dispatch,
`implementation=`, `check_support`, context parallelism and the CLI all ask the registry.
"""
from __future__ import annotations

import abc
from typing import Any, ClassVar

from sdpagraph.backends import sinks as sinks_mod
from sdpagraph.call import RuntimeInputs
from sdpagraph.graph_store import Verify
from sdpagraph.graphs.support import Support
from sdpagraph.scoremod.ir import ScoreModIR
from sdpagraph.spec import AttentionSpec


class Backend(abc.ABC):
    """One way to compute attention. Subclasses set `name` and implement `support` and `attention`.

    `verify` is the numerical check's gate that compiled kernels pass before they run user data
    (`numerics.gate.checked`, passed down by the layer above); backends that compile nothing ignore it."""

    name: ClassVar[str]
    # Whether the backend runs jax.numpy mods the score_mod IR cannot express (`scoremod.forms.PythonMods`).
    runs_python_mods: ClassVar[bool] = False
    # Whether a packed call with `max_seqlen_q` / `max_seqlen_kv` hints costs what the sequences its
    # hints bound cost (dispatch's prediction); otherwise it costs the dense (B, T, S).
    packs_by_hints: ClassVar[bool] = False

    @abc.abstractmethod
    def support(self, spec: AttentionSpec, score_mod: ScoreModIR | None, *, training: bool,
                verify: Verify | None = None) -> Support:
        """Whether this backend runs (spec, score_mod) here, and if not, why (`Support.reason`).
        May raise `cache.CacheMissError` when a strict cache lacks what the backend would build."""

    @abc.abstractmethod
    def attention(self, spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
                  score_mod: ScoreModIR | None, *, training: bool = True,
                  verify: Verify | None = None) -> tuple[Any, Any]:
        """(output, logsumexp) of the call; `training=False` may skip the softmax statistics."""

    def attention_with_sinks(self, spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs,
                             score_mod: ScoreModIR | None, sinks: Any, *, training: bool = True,
                             verify: Verify | None = None) -> tuple[Any, Any]:
        """(output, logsumexp) of the call with attention sinks `sinks` (N,) (`backends.sinks`), both
        with the sink (the logsumexp None where `training=False` let the backend keep none). This
        default composes them from `attention`'s logsumexp by autodiff, for backends whose backward
        honours the logsumexp's cotangent; a backend whose backward does not (one that takes the
        output and logsumexp it differentiates), or that has sinks of its own, overrides it."""
        out, lse = self.attention(spec, query, key, value, inputs, score_mod, training=True, verify=verify)
        return sinks_mod.apply(out, lse, sinks)

    def sinks_path(self, spec: AttentionSpec, score_mod: ScoreModIR | None, inputs: RuntimeInputs, *,
                   training: bool, verify: Verify | None = None) -> str:
        """How `attention_with_sinks` joins the sinks to this call (`check_support`'s words)."""
        return sinks_mod.COMPOSED

    def fp8_attention(self, spec: AttentionSpec, query: Any, key: Any, value: Any, inputs: RuntimeInputs, *,
                      verify: Verify | None = None) -> tuple[Any, Any]:
        """(output (B, T, N, H_v) in the inputs' FP8 dtype, amax of the output before `scale_o`, a float32
        scalar) of an FP8 spec (`spec.is_fp8`; the scales in `inputs.fp8_scales`), for a backend whose
        `support` takes FP8 specs; `sdpagraph.fp8` runs the others dequantized in bfloat16."""
        raise NotImplementedError(f"the {self.name} backend has no FP8 attention")

    def __repr__(self) -> str:
        return f"<sdpagraph backend {self.name!r}>"
