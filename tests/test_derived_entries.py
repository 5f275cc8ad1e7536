"""The calls a spec file's entries run as (`graphs.alternatives`) become entries of their own, so
precompile, verify and the numerical check cover them: a paged multi-token decode's folded prefix
(its forward graph alone), chunked attention as packed documents; paged and sinks specs survive a
spec file's round trip with their directions."""
import jax
import sdpagraph
import jax.numpy as jnp


from sdpagraph.call import prepare_call
from sdpagraph.deploy.derived_entries import with_derived
from sdpagraph.deploy.spec_entry import SpecEntry
from sdpagraph.deploy.specfile import load_specs, save_specs
from sdpagraph.graphs.decode_fold import decode_fold
from sdpagraph.paged import prepare_paged_call
from sdpagraph.spec import directions_for


def paged_call(t):
    q = jax.ShapeDtypeStruct((4, t, 8, 64), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((64, 16, 2, 64), jnp.bfloat16)
    table = jnp.zeros((4, 8), jnp.int32)
    return prepare_paged_call(q, pool, pool, table, is_causal=True, causal_alignment="bottom_right")


def test_a_multi_token_decode_brings_its_folded_prefix_with_its_forward_graph_alone():
    call = paged_call(4)
    entry = SpecEntry(call.spec, None, directions_for(False, call.spec))
    entries = with_derived([entry])
    folded = decode_fold(call.spec, None)
    assert entries == (entry, SpecEntry(folded, None, ("forward",)))
    assert (folded.q_len, folded.num_heads, folded.is_causal) == (16, 2, False)
    assert with_derived([SpecEntry(paged_call(1).spec, None, ("inference",))]) == (
        SpecEntry(paged_call(1).spec, None, ("inference",)),)  # decode: nothing folds


def test_chunked_attention_brings_its_documents():
    q = jax.ShapeDtypeStruct((2, 64, 8, 64), jnp.bfloat16)
    call = prepare_call(q, q, q, is_causal=True, chunk_size=16)
    [own, documents] = with_derived([SpecEntry(call.spec, None, directions_for(True))])
    assert (documents.spec.segments, documents.spec.max_segments, documents.spec.chunk_size) == ("self", 4, None)
    assert documents.directions == ("forward", "backward")


def test_paged_and_sinks_specs_round_trip_through_a_spec_file(tmp_path):
    paged = paged_call(4).spec
    sinks = prepare_call(jax.ShapeDtypeStruct((1, 32, 4, 64), jnp.bfloat16),
                                        jax.ShapeDtypeStruct((1, 32, 4, 64), jnp.bfloat16),
                                        jax.ShapeDtypeStruct((1, 32, 4, 64), jnp.bfloat16), is_causal=True).spec
    sinks = sinks.__class__(**{**sinks.__dict__, "sinks": True})
    entries = [SpecEntry(paged, None, ("forward",)), SpecEntry(sinks, None, ("forward",)),
               SpecEntry(sinks, None, ("inference",))]
    save_specs(tmp_path / "specs.json", entries)
    loaded = load_specs(tmp_path / "specs.json")
    assert sorted(e.identity for e in loaded) == sorted(e.identity for e in entries)
    assert all(e.training == (e.directions == ("forward",)) for e in loaded)


def test_recording_a_call_with_sinks_writes_its_graphs_and_those_with_cuDNNs_sinks(tmp_path, rng):
    q = jnp.asarray(rng.standard_normal((1, 16, 4, 8)), jnp.float32)
    with sdpagraph.record(tmp_path / "specs.json"):
        jax.grad(lambda q: sdpagraph.attention(q, q, q, is_causal=True, sinks=jnp.zeros((4,))).sum())(q)
    entries = {(e.spec.sinks, e.directions) for e in load_specs(tmp_path / "specs.json")}
    assert entries == {(False, ("forward", "backward")), (True, ("forward",))}
