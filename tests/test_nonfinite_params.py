"""Mod parameters that are not finite real numbers make every score NaN without an error: the
ready-made mods, spec files and `sdpagraph check --softcap` refuse them, naming the argument."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdpagraph
from sdpagraph import mods
from sdpagraph.cli import main
from sdpagraph.deploy import specfile
from sdpagraph.deploy.spec_entry import SpecFileError

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("make, message", [
    (lambda: mods.softcap(INF), "softcap cap must be finite, got inf: it would make the scores NaN; pass a finite cap"),
    (lambda: mods.softcap(NAN), "softcap cap must be finite, got nan"),
    (lambda: mods.softcap(-INF), "softcap cap must be finite, got -inf"),
    (lambda: mods.softcap(np.float64(1e39)), "softcap cap must be finite, got 1e+39 (beyond float32)"),
    (lambda: mods.alibi([0.5, INF, 0.25]), "alibi slopes must be finite, got inf at index 1"),
    (lambda: mods.alibi(np.array([NAN, 0.5])), "alibi slopes must be finite, got nan at index 0"),
    (lambda: mods.alibi(jnp.array([0.5, jnp.inf])), "alibi slopes must be finite, got inf at index 1"),
    (lambda: mods.relative_position_bias(np.array([[0.0, NAN, 1.0]]), 1),
     "relative_position_bias table must be finite, got nan at index (0, 1)"),
    (lambda: mods.relative_position_bias(np.array([[3e38, -3e38, 0.0]]), 1),
     "relative_position_bias table: neighbouring columns differ by more than float32 holds"),
])
def test_non_finite_parameters_are_refused_naming_the_argument(make, message):
    with pytest.raises(ValueError) as raised:
        make()
    assert message in str(raised.value)


@pytest.mark.parametrize("make, message", [
    (lambda: mods.softcap("30"), "softcap cap must be a real number (int or float), got str"),
    (lambda: mods.softcap(True), "softcap cap must be a real number (int or float), got bool"),
    (lambda: mods.alibi(["0.5", "0.25"]), "alibi slopes must be real numbers (int or float), got an array of str"),
    (lambda: mods.prefix_lm("3"), "prefix_lm prefix_len must be an int or a (B,) array of ints, got '3'"),
    (lambda: mods.prefix_lm(2.5), "prefix_lm prefix_len must be an int"),
])
def test_parameters_of_the_wrong_type_are_refused_naming_the_argument(make, message):
    with pytest.raises(TypeError) as raised:
        make()
    assert message in str(raised.value)


def test_a_huge_finite_cap_is_the_way_to_cap_nothing():
    """The fix the message suggests besides leaving the mod out: a finite cap, however large."""
    q, k, v = (jnp.asarray(np.random.default_rng(seed).standard_normal((1, 8, 2, 16)), jnp.float32)
               for seed in range(3))
    capped = sdpagraph.attention(q, k, v, score_mod=mods.softcap(1e30))
    np.testing.assert_allclose(capped, sdpagraph.attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_finite_and_traced_parameters_still_work():
    assert mods.softcap(30).tensors["cap"] == 30.0 and mods.softcap(np.float32(2.5)).tensors["cap"] == 2.5
    assert mods.alibi([1, 2]).tensors["slopes"].dtype == np.float32
    assert mods.prefix_lm(np.array([1, 2])).tensors["last_prefix"].ravel().tolist() == [0, 1]
    # Traced values cannot be checked when the mod is made: they become device operands.
    tensors = jax.jit(lambda cap, slopes: mods.compose(mods.softcap(cap), mods.alibi(slopes)).tensors)
    assert set(tensors(jnp.float32(jnp.inf), jnp.ones(2))) == {"0.cap", "1.slopes"}


def spec_file(tmp_path, score_mod):
    entry = {"shapes": {"query": [2, 16, 4, 64], "key": [2, 16, 4, 64], "value": [2, 16, 4, 64]},
             "dtype": "bfloat16", "score_mod": score_mod}
    path = tmp_path / "specs.json"
    path.write_text(json.dumps({"format": "sdpagraph-specs", "version": 1, "entries": [entry]}))
    return path


@pytest.mark.parametrize("score_mod, message", [
    ({"mod": "softcap", "args": [INF]}, "field 'score_mod': softcap cap must be finite, got inf"),
    ({"mod": "softcap", "args": [NAN]}, "field 'score_mod': softcap cap must be finite, got nan"),
    ([{"mod": "causal"}, {"mod": "alibi", "args": [[0.5, 0.25, 1e400, 0.125]]}],
     "field 'score_mod': alibi slopes must be finite, got inf at index 2"),
    ({"mod": "softcap", "args": ["30"]}, "field 'score_mod': softcap cap must be a real number (int or float), got str"),
    ({"mod": "softcap", "kwargs": {"cap": [30]}}, "field 'score_mod': softcap cap must be a scalar, got shape (1,)"),
])
def test_spec_files_refuse_them_naming_entry_field_and_argument(tmp_path, score_mod, message):
    path = spec_file(tmp_path, score_mod)
    with pytest.raises(SpecFileError) as raised:
        specfile.load_specs(path)
    assert str(raised.value) == f"{path}: entry 0: " + str(raised.value).split("entry 0: ", 1)[1]
    assert message in str(raised.value) and raised.value.field == "score_mod"


@pytest.mark.parametrize("cap", ["inf", "-inf", "nan", "Infinity", "1e39"])
def test_check_softcap_flag_refuses_them(capsys, cap):
    assert main(["check", "--query", "2,16,4,64", f"--softcap={cap}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("sdpagraph check: --softcap: softcap cap must be finite, got ")
    assert main(["check", "--query", "2,16,4,64", f"--softcap={cap}", "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["error"] in err and json.loads(out)["exit_code"] == 2
