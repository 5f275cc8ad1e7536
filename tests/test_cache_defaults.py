"""The process-wide cache and its environment variables."""
import os

import pytest

from sdpagraph.cache import GraphCache, default_cache, set_default_cache
from sdpagraph.cache.defaults import cache_from_env
from sdpagraph.config import CACHE_DIR, parse_size


@pytest.fixture(autouse=True)
def fresh_default():
    set_default_cache(None)
    yield
    set_default_cache(None)


def test_directory_defaults_follow_xdg_then_home():
    assert CACHE_DIR.get({"SDPAGRAPH_CACHE_DIR": "/srv/graphs"}) == "/srv/graphs"
    assert CACHE_DIR.get({"XDG_CACHE_HOME": "/x"}) == "/x/sdpagraph"
    assert CACHE_DIR.get({"XDG_CACHE_HOME": "", "SDPAGRAPH_CACHE_DIR": ""}) == \
        os.path.join(os.path.expanduser("~"), ".cache", "sdpagraph")


def test_environment_configures_the_cache(tmp_path):
    cache = cache_from_env({"SDPAGRAPH_CACHE_DIR": str(tmp_path), "SDPAGRAPH_CACHE_MODE": "strict",
                            "SDPAGRAPH_CACHE_MAX_BYTES": "64M"})
    assert (cache.directory, cache.mode, cache.max_bytes) == (str(tmp_path), "strict", 64 * 1024**2)
    cache = cache_from_env({"SDPAGRAPH_CACHE_DIR": str(tmp_path)})
    assert (cache.mode, cache.max_bytes) == ("readwrite", 2 * 1024**3)


def test_bad_environment_values_name_the_variable(tmp_path):
    with pytest.raises(ValueError) as raised:
        cache_from_env({"SDPAGRAPH_CACHE_DIR": str(tmp_path), "SDPAGRAPH_CACHE_MODE": "ro"})
    assert str(raised.value) == "SDPAGRAPH_CACHE_MODE must be one of readwrite, readonly, off, strict; got 'ro'"
    with pytest.raises(ValueError, match="SDPAGRAPH_CACHE_MAX_BYTES must be a byte count"):
        cache_from_env({"SDPAGRAPH_CACHE_DIR": str(tmp_path), "SDPAGRAPH_CACHE_MAX_BYTES": "-5"})


@pytest.mark.parametrize("text, expected", [("0", 0), ("1048576", 1048576), ("512K", 512 * 1024),
                                            ("64MiB", 64 * 1024**2), ("2g", 2 * 1024**3), (" 3 GB ", 3 * 1024**3)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_default_cache_is_shared_and_replaceable(monkeypatch, tmp_path):
    monkeypatch.setenv("SDPAGRAPH_CACHE_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("SDPAGRAPH_CACHE_MODE", "off")
    first = default_cache()
    assert default_cache() is first and first.mode == "off"
    mine = GraphCache(tmp_path / "mine")
    set_default_cache(mine)
    assert default_cache() is mine
    set_default_cache(None)
    monkeypatch.setenv("SDPAGRAPH_CACHE_MODE", "readonly")
    assert default_cache().mode == "readonly"
