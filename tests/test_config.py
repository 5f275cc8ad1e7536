"""`sdpagraph.config` declares every SDPAGRAPH_* variable, README's table shows exactly those, and
the readers parse as documented."""
import pathlib
import re

import pytest

from sdpagraph import config

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sdpagraph"
NAME = re.compile(r"SDPAGRAPH_[A-Z_]+")
# Reading the environment (setting a variable for a child process, os.environ.setdefault, is not).
READS_ENVIRONMENT = re.compile(r"\bos\.(environ\b(?!\.setdefault)|getenv\b)")


def readme_rows():
    section = re.search(r"^## Environment variables\n(.*?)^## ", (ROOT / "README.md").read_text(), re.S | re.M)
    assert section, "README.md has no 'Environment variables' section"
    return [line for line in section.group(1).splitlines() if line.startswith("|")]


def table_row(variable):
    default = f"`{variable.default}`" if variable.default else "unset"
    return f"| `{variable.name}` | {default} | {variable.doc} |"


def package_sources():
    return sorted(path for path in PACKAGE.rglob("*.py") if path.name != "config.py")


def test_readme_table_shows_exactly_the_declared_variables():
    expected = ["| Variable | Default | Meaning |", "| --- | --- | --- |"] + [table_row(v) for v in config.VARIABLES]
    assert readme_rows() == expected, "README's table, from config.VARIABLES:\n" + "\n".join(expected)


def test_variables_are_declared_once():
    names = [variable.name for variable in config.VARIABLES]
    assert len(names) == len(set(names)) and all(NAME.fullmatch(name) for name in names)


def test_every_variable_the_package_names_is_declared():
    declared = {variable.name for variable in config.VARIABLES}
    named = {(name, path.relative_to(ROOT).as_posix()) for path in package_sources()
             for name in NAME.findall(path.read_text())}
    assert sorted(item for item in named if item[0] not in declared) == []


def test_only_config_reads_the_environment():
    readers = [f"{path.relative_to(ROOT).as_posix()}:{number}: {line.strip()}" for path in package_sources()
               for number, line in enumerate(path.read_text().splitlines(), 1) if READS_ENVIRONMENT.search(line)]
    assert readers == []


def test_readers_read_the_environment_when_called(monkeypatch):
    monkeypatch.delenv(config.BINS.name, raising=False)
    assert config.BINS.enabled()
    monkeypatch.setenv(config.BINS.name, "0")
    assert not config.BINS.enabled()


@pytest.mark.parametrize("value, strict, words", [
    (None, True, True), ("1", True, True), ("", True, True), ("0", False, False), (" Off ", True, False),
    ("false", True, False), ("no", True, False), ("yes", True, True),
])
def test_switches(value, strict, words):
    environ = {} if value is None else {"SDPAGRAPH_BINS": value, "SDPAGRAPH_PARTITION": value}
    assert (config.BINS.enabled(environ), config.PARTITION.enabled(environ)) == (strict, words)


def test_choices_name_the_variable_and_the_value_given():
    assert config.VERIFY.get({}) == "build" and config.VERIFY.get({"SDPAGRAPH_VERIFY": " OFF "}) == "off"
    with pytest.raises(ValueError) as raised:
        config.VERIFY.get({"SDPAGRAPH_VERIFY": "Maybe"})
    assert str(raised.value) == "SDPAGRAPH_VERIFY must be one of build, off; got 'Maybe'"
    assert config.CACHE_MODE.get({"SDPAGRAPH_CACHE_MODE": ""}) == "readwrite"
    with pytest.raises(ValueError, match="SDPAGRAPH_CACHE_MODE must be one of readwrite, readonly, off, strict; "
                                         "got 'Strict'"):
        config.CACHE_MODE.get({"SDPAGRAPH_CACHE_MODE": "Strict"})


def test_sizes_and_texts():
    assert config.CACHE_MAX_BYTES.get({}) == 2 * 1024**3
    assert config.CACHE_MAX_BYTES.get({"SDPAGRAPH_CACHE_MAX_BYTES": "64M"}) == 64 * 1024**2
    with pytest.raises(ValueError, match="SDPAGRAPH_CACHE_MAX_BYTES must be a byte count"):
        config.CACHE_MAX_BYTES.get({"SDPAGRAPH_CACHE_MAX_BYTES": "lots"})
    assert config.RECORD.get({}) == "" and config.RECORD.get({"SDPAGRAPH_RECORD": "specs.json"}) == "specs.json"
