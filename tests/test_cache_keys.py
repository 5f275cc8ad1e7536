import hashlib
import json
from dataclasses import FrozenInstanceError, replace

import pytest

from sdpagraph.cache import CacheKey, key_digest
from sdpagraph.cache.keys import FORMAT_VERSION, key_text, key_versions, spec_of

KEY = CacheKey(spec="B4 S4096 H16 D128 bf16 causal", ir_hash="ab12", direction="forward",
               cudnn_version="9.19.0", frontend_version="1.32.0", gpu="sm90 NVIDIA H200")


def test_canonical_is_sorted_json_with_format_version():
    fields = json.loads(KEY.canonical())
    assert fields["format_version"] == FORMAT_VERSION == 1
    assert list(fields) == sorted(fields)
    assert fields["spec"] == KEY.spec and fields["gpu"] == KEY.gpu


def test_equal_keys_have_equal_canonical_text_and_digest():
    twin = CacheKey(**{name: getattr(KEY, name) for name in
                       ("spec", "ir_hash", "direction", "cudnn_version", "frontend_version", "gpu")})
    assert twin.canonical() == KEY.canonical()
    assert twin.digest() == KEY.digest() == hashlib.sha256(KEY.canonical().encode()).hexdigest()


@pytest.mark.parametrize("change", [
    {"spec": "B4 S4096 H16 D128 bf16"}, {"ir_hash": "ab13"}, {"direction": "backward"},
    {"cudnn_version": "9.20.0"}, {"frontend_version": "1.33.0"}, {"gpu": "sm100 NVIDIA B200"},
])
def test_every_field_changes_the_digest(change):
    assert replace(KEY, **change).digest() != KEY.digest()


def test_plain_string_keys():
    assert key_text("some key") == "some key"
    assert key_digest("some key") == hashlib.sha256(b"some key").hexdigest()
    assert key_digest(KEY) == KEY.digest()
    assert key_versions("some key") is None
    assert key_versions(KEY) == {"cudnn": "9.19.0", "frontend": "1.32.0", "gpu": "sm90 NVIDIA H200", "format": 1}


def test_invalid_keys_are_rejected():
    with pytest.raises(ValueError, match="direction"):
        replace(KEY, direction="sideways")
    with pytest.raises(TypeError, match="CacheKey.ir_hash"):
        replace(KEY, ir_hash=123)
    with pytest.raises(TypeError, match="CacheKey or str"):
        key_digest(42)
    with pytest.raises(FrozenInstanceError):
        KEY.spec = "other"


def test_spec_of_reads_the_spec_back_from_key_text():
    assert spec_of(KEY.canonical()) == KEY.spec
    assert spec_of("plain") == "plain"
    assert spec_of('{"no_spec": 1}') == '{"no_spec": 1}'
