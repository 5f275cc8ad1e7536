"""Spec files and cache entries written by earlier layouts of the package stay
valid: the spec file loads to the same specs, and the runtime's keys find the old entries, but for
the graphs whose lowering changed since (their keys carry the change)."""
import json
import shutil
from pathlib import Path

from sdpagraph.cache import GraphCache
from sdpagraph.graph_store import graph_key
from sdpagraph.deploy.specfile import load_specs
from sdpagraph.graphs.builder import SCALE_FOLDED, BuildEnvironment
from sdpagraph.scoremod.scale_folding import folds_leading_scale

DATA = Path(__file__).resolve().parent / "data" / "before-layout"


def test_a_spec_file_and_cache_made_before_the_move_are_found(tmp_path):
    made = json.loads((DATA / "keys.json").read_text())
    env = BuildEnvironment(*made["environment"])
    entries = load_specs(DATA / "specs.json")
    assert len(entries) == 4 and sum(entry.score_mod is not None for entry in entries) == 3
    directory = tmp_path / "cache"
    shutil.copytree(DATA / "cache", directory)  # a strict cache still records uses
    cache = GraphCache(str(directory), mode="strict")
    found, refolded = {}, set()
    for entry in entries:  # the file lists entries sorted, not in the order they were made
        for direction in entry.directions:
            key = graph_key(entry.spec, entry.score_mod, direction, env)
            if folds_leading_scale(entry.score_mod, direction):
                # The lowering changed for these graphs (softcap's division is the attention scale now):
                # their key says so, and the old, unfolded entry is not served.
                assert key.ir_hash.endswith(SCALE_FOLDED) and cache.get(key) is None
                refolded.add(key.digest())
                continue
            blob, meta = cache.get(key)
            _, made_as, made_for = blob.decode().split()  # "graph <index made> <direction>"
            assert made_for == direction and meta["summary"] == entry.spec.summary()
            found[f"{made_as}:{direction}"] = key.digest()
    assert len(found) == 4 and len(refolded) == 3  # a score_mod entry (ALiBi) among the ones found
    assert found == {name: digest for name, digest in made["digests"].items() if name in found}
