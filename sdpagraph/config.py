"""Every SDPAGRAPH_* environment variable: its name, default, meaning and typed reader.

A reader reads the variable when it is called (from `os.environ`, or from a mapping given), so a
variable changed while a process runs, or by a test's monkeypatch, counts from its next read.
`VARIABLES` lists them all; README's "Environment variables" table shows it (tests/test_config.py
keeps the two equal). The ground floor: this module imports nothing from sdpagraph.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

Environ = Optional[Mapping[str, str]]

# Values that switch off a `Switch` with `words`, compared after strip() and lower().
OFF_WORDS = ("0", "false", "off", "no")

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str, source: str = "size") -> int:
    """Bytes from "1048576", "512K", "64MiB", "2G" (units are powers of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{source} must be a byte count such as 1048576, 512M or 2G; got {text!r}")
    number, unit = match.groups()
    return int(number) * (_SIZE_UNITS[unit[0].upper()] if unit else 1)


def _environ(environ: Environ) -> Mapping[str, str]:
    return os.environ if environ is None else environ


_DETERMINISTIC_FLAG = re.compile(r"(?:^|\s)--xla_gpu_deterministic_ops(?:=(\S*))?(?=\s|$)")


def xla_deterministic_ops(environ: Environ = None) -> bool:
    """Whether XLA_FLAGS asks XLA for deterministic GPU ops (`--xla_gpu_deterministic_ops[=true]`;
    the last occurrence wins, as in XLA's flag parsing)."""
    found = _DETERMINISTIC_FLAG.findall(_environ(environ).get("XLA_FLAGS", ""))
    return bool(found) and found[-1].lower() in ("", "true", "1")


@dataclass(frozen=True)
class Variable:
    """One variable. `default` is what an unset variable means, as README shows it ("": nothing).
    A plain `Variable` is read by the build (CMakeLists.txt), not by the package."""

    name: str
    default: str
    doc: str

    def raw(self, environ: Environ = None) -> str | None:
        """The variable's text as set, None when unset."""
        return _environ(environ).get(self.name)


@dataclass(frozen=True)
class Text(Variable):
    """Free text (a path); unset and empty both mean `default`."""

    def get(self, environ: Environ = None) -> str:
        return self.raw(environ) or self.default


@dataclass(frozen=True)
class Switch(Variable):
    """On unless set to "0" or, with `words`, to one of OFF_WORDS."""

    words: bool = False

    def enabled(self, environ: Environ = None) -> bool:
        value = _environ(environ).get(self.name, self.default)
        return value.strip().lower() not in OFF_WORDS if self.words else value != "0"


@dataclass(frozen=True)
class Choice(Variable):
    """One of `choices` (compared after strip() and lower() with `fold_case`); unset and empty
    mean `default`; anything else raises ValueError naming the variable."""

    choices: tuple[str, ...] = ()
    fold_case: bool = False

    def get(self, environ: Environ = None) -> str:
        given = self.raw(environ)
        value = given or self.default
        if self.fold_case:
            value = value.strip().lower()
        if value not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}; got {given!r}")
        return value


@dataclass(frozen=True)
class Size(Variable):
    """A byte count (`parse_size`); unset and empty mean `default`; a bad one raises ValueError."""

    def get(self, environ: Environ = None) -> int:
        return parse_size(self.raw(environ) or self.default, source=self.name)


@dataclass(frozen=True)
class UserCacheDirectory(Variable):
    """A directory, `~` expanded; unset and empty mean sdpagraph's directory in the user's cache
    (`$XDG_CACHE_HOME`, else `~/.cache`)."""

    def get(self, environ: Environ = None) -> str:
        environ = _environ(environ)
        given = environ.get(self.name)
        if given:
            return os.path.expanduser(given)
        user_cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(user_cache, "sdpagraph")


CACHE_DIR = UserCacheDirectory(
    "SDPAGRAPH_CACHE_DIR", "$XDG_CACHE_HOME/sdpagraph",
    "the graph cache's directory (`~/.cache/sdpagraph` when XDG_CACHE_HOME is unset)")
CACHE_MODE = Choice(
    "SDPAGRAPH_CACHE_MODE", "readwrite",
    "`readwrite`: build misses and store them; `readonly`: never write the directory; `off`: memory "
    "only; `strict`: never build, a miss raises `CacheMissError` (docs/cache.md)",
    choices=("readwrite", "readonly", "off", "strict"))
CACHE_MAX_BYTES = Size(
    "SDPAGRAPH_CACHE_MAX_BYTES", "2G",
    "the cache directory's budget, in bytes or with K/M/G/T (powers of 1024); least recently used "
    "entries are evicted beyond it")
VERIFY = Choice(
    "SDPAGRAPH_VERIFY", "build",
    "`build`: check each new graph's numbers once, against the XLA backend, before it runs user "
    "data (docs/cache.md); `off`: never check",
    choices=("build", "off"), fold_case=True)
RECORD = Text(
    "SDPAGRAPH_RECORD", "",
    "a spec file that every attention call the process traces is recorded into (as in "
    "`sdpagraph.record`), for `sdpagraph precompile`")
DISPATCH_TABLE = Text(
    "SDPAGRAPH_DISPATCH_TABLE", "",
    "a JSON file of dispatch tables (`python bench/dispatch.py --write-table`) that add to or "
    "replace the built-in ones, by GPU name")
CHECK_SEGMENTS = Choice(
    "SDPAGRAPH_CHECK_SEGMENTS", "nan",
    "packed `segment_ids` that break `max_segments_per_seq` or a `max_seqlen_q` / `max_seqlen_kv` "
    "hint raise `ValueError` when concrete; when traced (under `jit`): `nan` gives their batch rows NaN "
    "output, computed on the device; `raise` raises when the call runs (a host callback per call, "
    "which ends XLA's command buffer and syncs); `off` (or `0`, `false`, `no`) checks nothing and drops "
    "the excess; `1` (`true`, `on`, `yes`) means `nan`",
    choices=("nan", "raise", "off"), fold_case=True)
BINS = Switch(
    "SDPAGRAPH_BINS", "1",
    "`0`: no packed call runs on bins, and no bins' graphs are built")
SMALL_SEQ_KERNEL = Switch(
    "SDPAGRAPH_SMALL_SEQ_KERNEL", "1",
    "`0`: the small-sequence backend never runs its Pallas kernel (its XLA formulation runs)")
PALLAS_TRITON = Switch(
    "SDPAGRAPH_PALLAS_TRITON", "1",
    "`0`: the Pallas kernels (small-sequence attention, the bin packer, the halo's row updates) never use "
    "Pallas' Triton backend, as when jax no longer has it: their XLA formulations run")
NATIVE_SINKS = Switch(
    "SDPAGRAPH_NATIVE_SINKS", "1",
    "`0`: attention sinks on cuDNN are composed from the logsumexp in the forward too, never cuDNN's own "
    "`sink_token` forward graph (for comparisons; docs/sinks.md)")
PARTITION = Switch(
    "SDPAGRAPH_PARTITION", "1",
    "`0`, `false`, `off` or `no`: cuDNN calls are not partitioned under SPMD: one call over the "
    "global shapes, which XLA gathers onto every device",
    words=True)
PREPARE = Switch(
    "SDPAGRAPH_PREPARE", "1",
    "`0`, `false`, `off` or `no`: a graph is deserialized on its device by its first run, not in a "
    "background thread while XLA compiles the program that calls it",
    words=True)
EXECUTOR_LIBRARY = Text(
    "SDPAGRAPH_EXECUTOR_LIBRARY", "",
    "the C++ executor library to load instead of the installed one (a build directory's)")
REQUIRE_FFI = Variable(
    "SDPAGRAPH_REQUIRE_FFI", "",
    "read by the build: `1` (or `ON`, `TRUE`, `YES`) makes `pip install` fail instead of skipping the "
    "C++ executor when headers or a C++ compiler are missing")
REBUILD_EXECUTOR = Variable(
    "SDPAGRAPH_REBUILD_EXECUTOR", "",
    "read by the build: `1` compiles the C++ executor even when `build/executor-cache/` holds one built "
    "from the same sources, compiler and headers")
COMMAND_BUFFER_COMPATIBLE = Variable(
    "SDPAGRAPH_COMMAND_BUFFER_COMPATIBLE", "ON",
    "a CMake option, not read from the environment (`pip install . -C "
    "cmake.define.SDPAGRAPH_COMMAND_BUFFER_COMPATIBLE=OFF`): `OFF` builds the executor without "
    "XLA's command-buffer trait")

VARIABLES: tuple[Variable, ...] = (
    CACHE_DIR, CACHE_MODE, CACHE_MAX_BYTES, VERIFY, RECORD, DISPATCH_TABLE, CHECK_SEGMENTS, BINS,
    SMALL_SEQ_KERNEL, PALLAS_TRITON, NATIVE_SINKS, PARTITION, PREPARE, EXECUTOR_LIBRARY, REQUIRE_FFI,
    REBUILD_EXECUTOR, COMMAND_BUFFER_COMPATIBLE,
)
