"""Errors that help: each bad input raises a TypeError / ValueError (in one line) that names the
argument and says what to pass instead."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.scoremod.ir import ScoreModError
from sdpagraph.call import MissingTensorError

B, T, S, N, K, H = 2, 8, 8, 4, 2, 16


def sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


Q, KV = sds((B, T, N, H)), sds((B, S, K, H))


def softcap(graph, score, tensors):
    return graph.tanh(input=score / tensors["cap"]) * tensors["cap"]


def raises(error, message, **kwargs):
    """The error `check_support` (the same argument path as `attention`) raises, checked to be
    one line."""
    args = dict(query=Q, key=KV, value=KV)
    args.update(kwargs)
    with pytest.raises(error, match=message) as info:
        sdpagraph.check_support(**args)
    assert "\n" not in str(info.value), str(info.value)
    return info.value


def test_score_mod_tensors_as_a_list_or_with_bad_names():
    raises(TypeError, r"score_mod_tensors must be a mapping of names to values, e.g. \{'cap': 30.0\}, got list",
           score_mod=softcap, score_mod_tensors=[30.0])
    raises(TypeError, r"score_mod_tensors must be a mapping.*got tuple", score_mod=softcap,
           score_mod_tensors=(("cap", 30.0),))
    raises(TypeError, "score_mod_tensors keys must be str names, got 0", score_mod=softcap,
           score_mod_tensors={0: 30.0})


def test_complex_and_boolean_tensors_name_the_entry():
    raises(TypeError, r"score_mod_tensors\['cap'\] must hold real numbers, got dtype complex64",
           score_mod=softcap, score_mod_tensors={"cap": np.ones((1,), np.complex64)})
    raises(TypeError, r"score_mod_tensors\['cap'\] is boolean", score_mod=softcap,
           score_mod_tensors={"cap": np.ones((1,), bool)})


@pytest.mark.parametrize("mod,function,advice", [
    (lambda g, s, t: jnp.tanh(s), "tanh", r"graph\.tanh\(input=\.\.\.\)"),
    (lambda g, s, t: jax.numpy.exp(s / 2), "exp", r"graph\.exp\(input=\.\.\.\)"),
    (lambda g, s, t: np.tanh(s), "tanh", r"graph\.tanh\(input=\.\.\.\)"),
    (lambda g, s, t: jnp.where(s > 0, s, 0.0), "where", r"graph\.binary_select\(input0=\.\.\., input1=\.\.\., mask=\.\.\.\)"),
    (lambda g, s, t: jnp.maximum(s, 0.0), "maximum", r"graph\.max\(input0=\.\.\., input1=\.\.\.\)"),
    (lambda g, s, t: jax.nn.gelu(s), "gelu", r"call the graph's ops instead \(graph\.tanh\(input=score\)"),
])
def test_a_graph_mod_calling_jax_numpy_points_to_the_graph_op(mod, function, advice):
    error = raises(ScoreModError, rf"score_mod called {function}\(\) on a graph tensor.*{advice}", score_mod=mod)
    assert isinstance(error, TypeError)


def test_a_mod_reading_a_missing_tensor_names_it_and_the_fix():
    message = (r"score_mod read tensors\['cap'\] \(KeyError\), a tensor it was not given \(tensors given: none\); "
               r"pass score_mod_tensors=\{'cap': value\}")
    error = raises(MissingTensorError, message, score_mod=softcap)
    assert isinstance(error, KeyError) and isinstance(error, ValueError)
    raises(ValueError, r"tensors\['cap'\].*tensors given: 'scale'", score_mod=softcap, score_mod_tensors={"scale": 2.0})
    # Inside compose, a plain callable sees the call's tensors.
    raises(ValueError, r"tensors\['cap'\]", score_mod=mods.compose(mods.causal(), softcap))
    # A KeyError of the mod's own (not a tensor lookup) is left alone.
    own = {}
    with pytest.raises(KeyError) as info:
        sdpagraph.check_support(Q, KV, KV, score_mod=lambda g, s, t: s + own["x"] if t else s,
                                score_mod_tensors={"x": 1.0})
    assert not isinstance(info.value, MissingTensorError)


def test_traced_values_in_mods_that_shape_the_mask():
    for make, what in ((mods.sliding_window, "sliding_window left"), (mods.chunked, "chunked size")):
        with pytest.raises(TypeError, match=rf"{what} must be a Python int, got a traced value.*static_argnums"):
            jax.jit(lambda x, make=make: sdpagraph.check_support(Q, KV, KV, score_mod=make(x)))(3)
    with pytest.raises(TypeError, match="sliding_window right must be a Python int, got float"):
        mods.sliding_window(2, 1.5)
    with pytest.raises(ValueError, match="softcap cap must be a scalar"):
        jax.jit(lambda c: mods.softcap(c))(jnp.ones(2))


@pytest.mark.parametrize("argname", ["bias", "mask"])
def test_bias_and_mask_shapes(argname):
    dtype = jnp.float32 if argname == "bias" else jnp.bool_
    raises(ValueError, rf"{argname} has rank 5, shape \(1, 1, 1, {T}, {S}\); it must have at most 4 dims",
           **{argname: sds((1, 1, 1, T, S), dtype)})
    raises(ValueError, rf"{argname} shape \({T + 1}, {S}\) is not broadcastable to \(B, N, T, S\)=\({B}, {N}, {T}, {S}\): "
                       rf"axis T has size {T + 1}, which must be 1 or {T}", **{argname: sds((T + 1, S), dtype)})
    raises(ValueError, rf"axis N has size 3, which must be 1 or {N}", **{argname: sds((3, T, S), dtype)})


def test_zero_head_dim_and_segment_bounds():
    raises(ValueError, "the head dim H of query and key is 0", query=sds((B, T, N, 0)), key=sds((B, S, K, 0)),
           value=sds((B, S, K, 0)))
    ids = np.zeros((B, T), np.int32)
    ids[1, :6] = np.arange(1, 7)
    raises(ValueError, r"segment_ids: row 1 has 6 segments, more than max_segments_per_seq=5; segments past "
                       r"the bound would be dropped: pass max_segments_per_seq >= 6",
           segment_ids=ids, max_segments_per_seq=5)
    raises(ValueError, r"segment_ids\[0\]: row 1 has 6 segments", segment_ids=(ids, ids), max_segments_per_seq=2)
