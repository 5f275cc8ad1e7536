"""A cache directory that cannot be written (read-only, missing, full) degrades to memory
with one warning; the directory is private and a shared one is flagged."""
import errno
import os
import stat

import pytest

from sdpagraph.cache import CacheMissError, GraphCache

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def cache_warnings(caplog):
    return [record.getMessage() for record in caplog.records if record.name == "sdpagraph.cache"]


def fail_writes_under(monkeypatch, directory, error_number):
    """Make every write-like OS call under `directory` fail like a read-only mount does."""
    root = os.fspath(directory)

    def failing(function, is_write=lambda *args: True):
        def call(path, *args, **kwargs):
            if os.fspath(path).startswith(root) and is_write(*args):
                raise OSError(error_number, os.strerror(error_number), os.fspath(path))
            return function(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "open", failing(os.open, lambda flags, *rest: flags & WRITE_FLAGS))
    for name in ("mkdir", "utime", "unlink", "replace", "rename"):
        monkeypatch.setattr(os, name, failing(getattr(os, name)))


def test_read_only_directory_keeps_working_from_memory(tmp_path, monkeypatch, caplog):
    GraphCache(tmp_path).get_or_build("old", lambda: (b"on disk", {}))
    fail_writes_under(monkeypatch, tmp_path, errno.EROFS)
    cache = GraphCache(tmp_path)
    assert cache.get_or_build("old", lambda: pytest.fail("must load from disk"))[0] == b"on disk"
    for key in ("new-1", "new-2", "new-1"):
        assert cache.get_or_build(key, lambda: (key.encode(), {}))[0] == key.encode()
    assert cache.stats()["builds"] == 2 and cache.entry_path("new-1") is None
    [warning] = cache_warnings(caplog)
    assert f"cannot write to cache directory {tmp_path} (Read-only file system" in warning
    assert "new graphs are kept in memory only" in warning


def test_readonly_mode_works_on_a_read_only_mount_without_trying_to_write(tmp_path, monkeypatch, caplog):
    GraphCache(tmp_path).get_or_build("old", lambda: (b"on disk", {}))
    fail_writes_under(monkeypatch, tmp_path, errno.EROFS)
    cache = GraphCache(tmp_path, mode="readonly")
    assert cache.get_or_build("old", lambda: pytest.fail("must load from disk"))[0] == b"on disk"
    assert cache.get_or_build("new", lambda: (b"built", {}))[0] == b"built"
    assert cache_warnings(caplog) == []


def test_directory_that_cannot_be_created(tmp_path, monkeypatch, caplog):
    fail_writes_under(monkeypatch, tmp_path, errno.EACCES)
    cache = GraphCache(tmp_path / "sub" / "cache")
    assert cache.get_or_build("k", lambda: (b"built", {}))[0] == b"built"
    assert cache.get_or_build("k", lambda: pytest.fail("memory hit expected"))[0] == b"built"
    [warning] = cache_warnings(caplog)
    assert "cannot write to cache directory" in warning and "Permission denied while creating it" in warning


def test_full_disk_keeps_working_and_leaves_no_partial_file(tmp_path, monkeypatch, caplog):
    cache = GraphCache(tmp_path)

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", no_space)
    for key in ("a", "b", "a"):
        assert cache.get_or_build(key, lambda: (b"x" * 1000, {}))[0] == b"x" * 1000
    assert cache.stats()["write_errors"] == 2 and cache.stats()["builds"] == 2
    assert [w for w in cache_warnings(caplog) if "No space left" in w] == cache_warnings(caplog)
    assert len(cache_warnings(caplog)) == 1
    leftovers = [name for _, _, names in os.walk(tmp_path) for name in names if not name.endswith(".lock")]
    assert leftovers == []
    monkeypatch.undo()
    cache.put("c", b"space again", {})
    assert GraphCache(tmp_path).get("c")[0] == b"space again"


def test_new_directory_is_private(tmp_path):
    cache = GraphCache(tmp_path / "a" / "cache")
    cache.get_or_build("k", lambda: (b"x", {}))
    shard = os.path.dirname(cache.entry_path("k"))
    for directory in (cache.directory, shard):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cache.entry_path("k")).st_mode) == 0o600


@pytest.mark.parametrize("mode, warned", [(0o700, False), (0o750, False), (0o770, True), (0o777, True)])
def test_shared_writable_directory_is_flagged_once(tmp_path, caplog, mode, warned):
    directory = tmp_path / "cache"
    directory.mkdir()
    os.chmod(directory, mode)
    cache = GraphCache(directory)
    cache.get_or_build("k", lambda: (b"x", {}))
    cache.get_or_build("j", lambda: (b"y", {}))
    flagged = [w for w in cache_warnings(caplog) if "group/world-writable" in w]
    assert flagged == ([f"cache directory {directory} is group/world-writable (mode {oct(mode)}); other users "
                        f"could plant graphs that this process runs. Run: chmod 700 {directory}"] if warned else [])


def lookups(cache, keys):
    """get_or_build each key: built in memory, or (strict) a CacheMissError naming why."""
    reasons = []
    for key in keys:
        if cache.mode == "strict":
            with pytest.raises(CacheMissError) as raised:
                cache.get_or_build(key, pytest.fail)
            reasons.append(str(raised.value))
        else:
            assert cache.get_or_build(key, lambda: (b"built", {}))[0] == b"built"
    return reasons


@pytest.mark.parametrize("mode", ["readwrite", "readonly", "strict"])
@pytest.mark.parametrize("below", [False, True], ids=["file", "below_a_file"])
def test_a_file_as_the_directory_warns_once_not_per_key(tmp_path, caplog, mode, below):
    path = tmp_path / "a_file"
    path.write_bytes(b"not a directory")
    directory = path / "cache" if below else path
    cache = GraphCache(directory, mode=mode)
    reasons = lookups(cache, ["k1", "k2", "k3", "k1"])
    [warning] = cache_warnings(caplog)
    assert str(directory) in warning and "not a directory" in warning.lower()
    assert "ignoring cache entry" not in caplog.text and cache.stats()["invalid_entries"] == 0
    assert all("Not a directory" in reason for reason in reasons)
    assert path.read_bytes() == b"not a directory"


def deny_search(monkeypatch, directory):
    """Nothing below `directory` can be opened or stat'ed, as when this user may not search it
    (root may search any directory, so the tests make the OS say no)."""
    below = os.fspath(directory) + os.sep

    def refusing(function):
        def call(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(below):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
            return function(path, *args, **kwargs)
        return call

    for name in ("open", "stat", "mkdir"):
        monkeypatch.setattr(os, name, refusing(getattr(os, name)))


@pytest.mark.parametrize("mode", ["readwrite", "readonly", "strict"])
def test_a_directory_that_cannot_be_searched_warns_once_not_per_key(tmp_path, monkeypatch, caplog, mode):
    GraphCache(tmp_path).get_or_build("k1", lambda: (b"on disk", {}))
    deny_search(monkeypatch, tmp_path)
    cache = GraphCache(tmp_path, mode=mode)
    reasons = lookups(cache, ["k1", "k2", "k3", "k2"])
    assert cache_warnings(caplog) == [f"cannot read cache directory {tmp_path} (Permission denied); every lookup "
                                      "there misses"]
    assert cache.stats()["invalid_entries"] == 0
    assert all(f"cannot read cache directory {tmp_path} (Permission denied)" in reason for reason in reasons)
