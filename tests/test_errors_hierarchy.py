"""Every public sdpagraph error is a `SdpagraphError` and keeps the builtin error it always was, so
`except sdpagraph.SdpagraphError` and `except ValueError` (etc.) both catch it."""
import ast
import builtins
import importlib
import pathlib

import pytest

import sdpagraph
from sdpagraph.errors import SdpagraphError

PACKAGE = pathlib.Path(sdpagraph.__file__).resolve().parent
BUILTIN_ERRORS = {name for name, value in vars(builtins).items()
                  if isinstance(value, type) and issubclass(value, BaseException)}

# (module, class, the builtin errors it must stay)
PUBLIC_ERRORS = [
    ("sdpagraph.errors", "Unsupported", (ValueError,)),
    ("sdpagraph.scoremod.ir", "ScoreModError", (TypeError,)),
    ("sdpagraph.scoremod.jnp.interpreter", "JnpModUnsupported", (ValueError,)),
    ("sdpagraph.graphs.builder", "GraphBuildError", (RuntimeError,)),
    ("sdpagraph.cache.graph_cache", "CacheMissError", (LookupError,)),
    ("sdpagraph.cache.entry", "CorruptEntry", (ValueError,)),
    ("sdpagraph.numerics.gate", "UncheckedGraphError", (LookupError,)),
    ("sdpagraph.deploy.precompile", "BuilderUnavailable", (RuntimeError,)),
    ("sdpagraph.deploy.spec_entry", "SpecFileError", (ValueError,)),
    ("sdpagraph.call", "MissingTensorError", (KeyError, ValueError)),
]


def test_the_base_class_is_public_and_loads_nothing_else():
    assert sdpagraph.SdpagraphError is SdpagraphError and "SdpagraphError" in sdpagraph.__all__
    assert issubclass(SdpagraphError, Exception)


@pytest.mark.parametrize("module, name, builtin_bases", PUBLIC_ERRORS, ids=[name for _, name, _ in PUBLIC_ERRORS])
def test_public_errors_are_sdpagraph_errors_and_keep_their_builtin_base(module, name, builtin_bases):
    error = getattr(importlib.import_module(module), name)
    assert issubclass(error, SdpagraphError)
    for base in builtin_bases:
        assert issubclass(error, base)


def test_every_public_error_class_in_the_package_derives_from_sdpagraph_error():
    """A public class with a builtin error among its bases names SdpagraphError among them too
    (classes that derive from another sdpagraph error inherit it)."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {base.id for base in node.bases if isinstance(base, ast.Name)}
                if bases & BUILTIN_ERRORS and "SdpagraphError" not in bases and node.name != "SdpagraphError":
                    missing.append(f"{path.relative_to(PACKAGE.parent)}: {node.name}")
    assert missing == []
