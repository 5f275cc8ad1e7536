"""Bad input gets a clear ValueError/TypeError naming the argument."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods

B, T, S, N, K, H = 2, 8, 8, 4, 2, 16


def arrays(dtype=jnp.float32):
    rng = np.random.default_rng()
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))


def sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


CASES = [
    ("rank", dict(query=sds((B, T, N, H, 1))), ValueError, "4-D"),
    ("batch", dict(key=sds((B + 1, S, K, H)), value=sds((B + 1, S, K, H))), ValueError, "batch sizes differ"),
    ("head_dim", dict(key=sds((B, S, K, H + 8)), value=sds((B, S, K, H + 8))), ValueError, "head dim"),
    ("heads", dict(key=sds((B, S, 3, H)), value=sds((B, S, 3, H))), ValueError, "multiple of key/value heads"),
    ("mixed_dtypes", dict(key=sds((B, S, K, H), jnp.bfloat16)), TypeError, "share one dtype"),
    ("int_dtype", dict(query=sds((B, T, N, H), jnp.int32), key=sds((B, S, K, H), jnp.int32),
                       value=sds((B, S, K, H), jnp.int32)), TypeError, "query dtype"),
    ("segment_dtype", dict(segment_ids=sds((B, T), jnp.float32)), TypeError, "segment_ids"),
    ("segment_shape", dict(segment_ids=sds((B, T + 1), jnp.int32)), ValueError, "segment_ids"),
    ("segment_max", dict(segment_ids=sds((B, T), jnp.int32), max_segments_per_seq=0), ValueError, "max_segments_per_seq"),
    ("chunk", dict(chunk_size=0), ValueError, "chunk_size"),
    ("window", dict(local_window_size=(-2, 3)), ValueError, "local_window_size"),
    ("window_type", dict(local_window_size=2.5), TypeError, "local_window_size"),
    ("implementation", dict(implementation="triton"), ValueError, "implementation"),
    ("alignment", dict(causal_alignment="diagonal"), ValueError, "causal_alignment"),
    ("bias_shape", dict(bias=sds((B, N, T, S + 1))), ValueError, "bias"),
    ("mask_dtype", dict(mask=sds((B, 1, T, S), jnp.float32)), TypeError, "mask"),
    ("lengths", dict(query_seq_lengths=sds((B + 1,), jnp.int32)), ValueError, "query_seq_lengths"),
    ("mod_not_tensor", dict(score_mod=lambda g, s, t: 1.0), TypeError, "must return a graph tensor"),
    ("mod_unknown_op", dict(score_mod=lambda g, s, t: g.gelu(input=s)), TypeError, "unknown op 'gelu'"),
    ("mod_tensor_shape", dict(score_mod=lambda g, s, t: s + t["x"], score_mod_tensors={"x": np.ones((3, 1, 1))}),
     ValueError, r"score_mod_tensors\['x'\]"),
    ("mod_tensor_type", dict(score_mod=lambda g, s, t: s + t["x"], score_mod_tensors={"x": "big"}),
     TypeError, r"score_mod_tensors\['x'\]"),
    ("tensors_without_mod", dict(score_mod_tensors={"x": 1.0}), ValueError, "need a score_mod"),
    ("mod_not_callable", dict(score_mod=3), TypeError, "score_mod must be callable"),
]


@pytest.mark.parametrize("override,error,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_arguments_raise_naming_the_argument(override, error, message):
    q, k, v = (sds(x.shape) for x in arrays())
    args = dict(query=q, key=k, value=v)
    args.update(override)
    with pytest.raises(error, match=message):
        sdpagraph.check_support(**args)


def test_attention_raises_the_same_errors_as_the_query():
    q, k, v = arrays()
    with pytest.raises(ValueError, match="segment_ids must be >= 0"):
        sdpagraph.attention(q, k, v, segment_ids=-jnp.ones((B, T), jnp.int32))
    with pytest.raises(ValueError, match="key_value_seq_lengths must lie in"):
        sdpagraph.attention(q, k, v, key_value_seq_lengths=jnp.asarray([S + 1, 2], jnp.int32))
    with pytest.raises(ValueError, match="chunk_size"):
        sdpagraph.attention(q, k, v, chunk_size=-4)
    with pytest.raises(ValueError, match="softcap"):
        mods.softcap(0.0)
    with pytest.raises(ValueError, match="alibi"):
        mods.alibi(np.ones((2, 2)))
