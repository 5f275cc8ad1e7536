"""The entry file format is written in Python (cache/entry.py, cache/keys.py) and read in C++
(ffi/csrc/entry_file.cc, which loads entries on its own): both sides must use the same constants."""
import re
from pathlib import Path

from sdpagraph.cache import entry, keys
from sdpagraph.graphs import builder

# The executor's C++ sources; the constants below live in entry_file.cc, graph_registry.cc and
# cudnn_library.cc, but are looked for in all of them so that moving one between files is no failure.
EXECUTOR_SOURCES = Path(__file__).resolve().parents[1] / "sdpagraph" / "ffi" / "csrc"


def cpp_source():
    files = sorted(EXECUTOR_SOURCES.glob("*.h")) + sorted(EXECUTOR_SOURCES.glob("*.cc"))
    assert files, f"no C++ sources in {EXECUTOR_SOURCES}"
    return "\n".join(path.read_text() for path in files)


def cpp_constant(name):
    matches = re.findall(rf"constexpr\s+[\w:<>,* ]+\s+{name}\s*=\s*([^;]+);", cpp_source())
    assert len(matches) == 1, f"{name} defined {len(matches)} times in {EXECUTOR_SOURCES}, not once"
    return matches[0].strip()


def test_magic_version_and_header_size_agree():
    chars = re.findall(r"'(.)'", cpp_constant("kEntryMagic"))
    assert "".join(chars).encode() == entry.MAGIC
    assert int(cpp_constant("kEntryFormatVersion")) == keys.FORMAT_VERSION
    # The C++ header is the magic plus two u32 (version, crc32), little-endian like struct "<8sII".
    assert cpp_constant("kEntryHeaderSize") == "kEntryMagic.size() + 2 * sizeof(uint32_t)"
    assert entry.HEADER.format == "<8sII" and entry.HEADER.size == len(entry.MAGIC) + 8


def test_payload_fields_the_executor_reads_are_written_by_python():
    read_by_cpp = set(re.findall(r'field == "(\w+)"', cpp_source()))
    assert read_by_cpp == {"key_hash", "blob"}
    assert read_by_cpp <= set(entry._FIELD_TYPES)
    assert entry._FIELD_TYPES["blob"] is bytes and entry._FIELD_TYPES["key_hash"] is str


def test_key_digest_and_library_names_agree():
    # Graph keys are sha256 hex digests: what IsGraphKey accepts is what key_digest produces.
    assert int(cpp_constant("kSha256HexDigits")) == len(keys.key_digest("any key")) == 64
    assert cpp_constant("kCudnnSoname") == f'"{builder.CUDNN_SONAME}"'
    assert "(zlib.crc32)" in cpp_source()  # the checksum the Python side writes (entry.encode_entry)
