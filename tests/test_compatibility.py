"""Spec files and cache entries written by earlier layouts of the package stay
valid: the spec file loads to the same specs, and the runtime's keys find the old entries."""
import json
import shutil
from pathlib import Path

from sdpagraph.cache import GraphCache
from sdpagraph.graph_store import graph_key
from sdpagraph.deploy.specfile import load_specs
from sdpagraph.graphs.builder import BuildEnvironment

DATA = Path(__file__).resolve().parent / "data" / "before-layout"


def test_a_spec_file_and_cache_made_before_the_move_are_found(tmp_path):
    made = json.loads((DATA / "keys.json").read_text())
    env = BuildEnvironment(*made["environment"])
    entries = load_specs(DATA / "specs.json")
    assert len(entries) == 4 and sum(entry.score_mod is not None for entry in entries) == 3
    directory = tmp_path / "cache"
    shutil.copytree(DATA / "cache", directory)  # a strict cache still records uses
    cache = GraphCache(str(directory), mode="strict")
    found = {}
    for entry in entries:  # the file lists entries sorted, not in the order they were made
        for direction in entry.directions:
            key = graph_key(entry.spec, entry.score_mod, direction, env)
            blob, meta = cache.get(key)
            _, made_as, made_for = blob.decode().split()  # "graph <index made> <direction>"
            assert made_for == direction and meta["summary"] == entry.spec.summary()
            found[f"{made_as}:{direction}"] = key.digest()
    assert found == made["digests"]
