"""Every Python block of docs/deployment.md runs as pasted: no indentation from the list around
it, and the blocks that need no GPU run in order (record a spec file, then read it back)."""
import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "deployment.md"
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)


def python_blocks():
    return [match.group(2) for match in BLOCK.finditer(DOC.read_text())]


def test_every_python_block_compiles_as_pasted():
    blocks = python_blocks()
    assert len(blocks) >= 3
    for block in blocks:
        compile(block, str(DOC), "exec")  # an indented block raises IndentationError here


def test_the_blocks_without_a_gpu_run_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runnable = [block for block in python_blocks() if "precompile(" not in block]  # precompile needs a GPU
    if not runnable:
        pytest.fail("no runnable Python block in docs/deployment.md")
    for block in runnable:
        exec(compile(block, str(DOC), "exec"), {"__name__": "__main__"})
    from sdpagraph.deploy import specfile

    [entry] = specfile.load_specs(tmp_path / "specs.json")
    assert entry.spec.is_causal and entry.score_mod is not None
    assert specfile.load_specs(tmp_path / "all.json") == specfile.load_specs(tmp_path / "more.json") == [entry]
