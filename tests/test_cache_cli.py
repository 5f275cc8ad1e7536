"""`sdpagraph cache ls|info|verify|prune|clear`, human and --json."""
import json
import os

import pytest

from sdpagraph import cli
from sdpagraph.cache import CacheKey, GraphCache, key_digest
from sdpagraph.cache.disk import DiskStore

KEY = CacheKey(spec="B4 S4096 H16 D128 bf16 causal", ir_hash="77aa", direction="forward",
               cudnn_version="9.19.0", frontend_version="1.32.0", gpu="sm90 NVIDIA H200")


@pytest.fixture
def cache_dir(tmp_path):
    directory = tmp_path / "cache"
    cache = GraphCache(directory)
    cache.put(KEY, b"k" * 3000, {"workspace": 8})
    cache.put("plain key", b"p" * 10, {"summary": "a short summary"})
    return directory


def run(capsys, *argv):
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def run_json(capsys, *argv):
    code, out = run(capsys, *argv, "--json")
    return code, json.loads(out)


def damage(directory, key):
    path = GraphCache(directory).entry_path(key)
    with open(path, "r+b") as file:
        file.seek(-5, os.SEEK_END)
        file.write(b"XXXXX")
    return path


def test_ls_table(cache_dir, capsys):
    code, out = run(capsys, "cache", "ls", "--cache-dir", str(cache_dir))
    header, *rows, footer = out.splitlines()
    assert code == 0 and header.split() == ["KEY", "SPEC", "SIZE", "AGE", "LAST", "USE"]
    assert any(row.startswith(KEY.digest()[:12]) and KEY.spec in row for row in rows)
    assert any("a short summary" in row for row in rows)
    assert footer.startswith("2 entries")


def test_ls_json_and_a_bad_entry(cache_dir, capsys):
    damage(cache_dir, "plain key")
    code, data = run_json(capsys, "cache", "ls", "--cache-dir", str(cache_dir))
    rows = {row["digest"]: row for row in data["entries"]}
    assert code == 0 and set(rows) == {KEY.digest(), key_digest("plain key")}
    assert rows[KEY.digest()]["spec"] == KEY.spec and rows[KEY.digest()]["valid"]
    assert rows[KEY.digest()]["size"] == os.path.getsize(rows[KEY.digest()]["path"])
    assert not rows[key_digest("plain key")]["valid"] and "checksum" in rows[key_digest("plain key")]["problem"]
    _, out = run(capsys, "cache", "ls", "--cache-dir", str(cache_dir))
    assert "<invalid: checksum mismatch" in out


def test_info_by_prefix(cache_dir, capsys):
    code, data = run_json(capsys, "cache", "info", KEY.digest()[:8], "--cache-dir", str(cache_dir))
    assert code == 0
    assert data["key"] == KEY.canonical() and data["meta"]["workspace"] == 8
    assert data["versions"]["cudnn"] == "9.19.0" and data["spec"] == KEY.spec
    code, out = run(capsys, "cache", "info", KEY.digest()[:8], "--cache-dir", str(cache_dir))
    assert code == 0 and "blob_sha256" in out and KEY.digest() in out


def test_info_without_a_unique_match(cache_dir, capsys):
    assert run(capsys, "cache", "info", "zz", "--cache-dir", str(cache_dir)) == (
        1, f"no entry matches 'zz' in {cache_dir}\n")
    code, out = run(capsys, "cache", "info", "", "--cache-dir", str(cache_dir))
    assert code == 1 and "2 entries match" in out


def test_verify_reports_then_removes_bad_entries(cache_dir, capsys):
    assert run(capsys, "cache", "verify", "--cache-dir", str(cache_dir))[0] == 0
    path = damage(cache_dir, KEY)
    code, data = run_json(capsys, "cache", "verify", "--cache-dir", str(cache_dir))
    assert code == 1 and data["checked"] == 2
    assert [(bad["digest"], bad["removed"]) for bad in data["bad"]] == [(KEY.digest(), False)]
    assert os.path.exists(path)
    code, out = run(capsys, "cache", "verify", "--remove", "--cache-dir", str(cache_dir))
    assert code == 1 and "(removed)" in out and not os.path.exists(path)
    code, out = run(capsys, "cache", "verify", "--cache-dir", str(cache_dir))
    assert code == 0 and out == f"checked 1 entry in {cache_dir}: all valid\n"


def test_prune_drops_least_recently_used(cache_dir, capsys):
    old = GraphCache(cache_dir).entry_path(KEY)
    os.utime(old, (1, 1))
    code, data = run_json(capsys, "cache", "prune", "--max-bytes", "1K", "--cache-dir", str(cache_dir))
    assert code == 0 and data["removed"] == [KEY.digest()]
    assert data["bytes_after"] <= 1024 < data["bytes_before"]
    assert not os.path.exists(old)


def test_clear_removes_entries_and_lock_files(cache_dir, capsys):
    code, out = run(capsys, "cache", "clear", "--cache-dir", str(cache_dir))
    assert code == 0 and out.startswith("removed 2 entries")
    assert [name for _, _, names in os.walk(cache_dir) for name in names] == []


def test_default_directory_comes_from_the_environment(cache_dir, capsys, monkeypatch):
    monkeypatch.setenv("SDPAGRAPH_CACHE_DIR", str(cache_dir))
    code, data = run_json(capsys, "cache", "ls")
    assert code == 0 and data["directory"] == str(cache_dir) and len(data["entries"]) == 2


ACTIONS = [["ls"], ["info", "ab"], ["verify"], ["verify", "--remove"], ["prune", "--max-bytes", "0"], ["clear"]]
WRITING_ACTIONS = [["verify", "--remove"], ["prune", "--max-bytes", "0"], ["clear"]]


@pytest.mark.parametrize("action", [["ls"], ["verify"], ["prune", "--max-bytes", "0"], ["clear"]])
def test_missing_directory_is_reported_not_created(tmp_path, capsys, action):
    code, out = run(capsys, "cache", *action, "--cache-dir", str(tmp_path / "absent"))
    assert code == 0
    assert out == f"no cache directory at {tmp_path / 'absent'}: it does not exist (nothing is cached there)\n"
    assert not (tmp_path / "absent").exists()


def error_line(capsys, *argv):
    """Run a cache command that must fail: exit 2, one line on stderr, nothing on stdout."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, (argv, out, err)
    return err.strip()


@pytest.mark.parametrize("action", ACTIONS)
def test_a_file_is_not_a_cache_directory(tmp_path, capsys, action):
    path = tmp_path / "a_file"
    path.write_bytes(b"not a directory")
    assert error_line(capsys, "cache", *action, "--cache-dir", str(path)) == \
        f"sdpagraph cache {action[0]}: {path} is not a directory"
    code, data = run_json(capsys, "cache", *action, "--cache-dir", str(path))
    assert code == data["exit_code"] == 2 and data["error"] == f"{path} is not a directory"
    assert path.read_bytes() == b"not a directory"
    assert error_line(capsys, "cache", *action, "--cache-dir", str(path / "below")).startswith(
        f"sdpagraph cache {action[0]}: {path / 'below'} is not a directory")


def refuse_access(monkeypatch, denied, mode):
    """os.access says no for `mode` on the paths in `denied` (root passes any real permission check)."""
    real_access = os.access

    def access(path, wanted, **kwargs):
        if os.fspath(path) in denied and wanted & mode:
            return False
        return real_access(path, wanted, **kwargs)

    monkeypatch.setattr(os, "access", access)


@pytest.mark.parametrize("action", WRITING_ACTIONS)
def test_removing_from_a_directory_this_user_cannot_write_is_an_error(cache_dir, capsys, monkeypatch, action):
    damage(cache_dir, KEY)  # something for verify --remove to remove
    shards = sorted(str(path) for path in cache_dir.iterdir() if path.is_dir())
    files_before = sorted(cache_dir.rglob("*"))
    refuse_access(monkeypatch, {shards[-1]}, os.W_OK)
    line = error_line(capsys, "cache", *action, "--cache-dir", str(cache_dir))
    assert line == (f"sdpagraph cache {action[0]}: permission denied: cannot write to {shards[-1]} "
                    "(its entries cannot be removed); nothing was removed")
    assert "other processes" not in line
    assert sorted(cache_dir.rglob("*")) == files_before
    code, data = run_json(capsys, "cache", *action, "--cache-dir", str(cache_dir))
    assert code == data["exit_code"] == 2 and data["error"].startswith("permission denied")
    # Reading needs no write permission.
    assert run(capsys, "cache", "ls", "--cache-dir", str(cache_dir))[0] == 0
    assert run(capsys, "cache", "verify", "--cache-dir", str(cache_dir))[0] == 1  # the damaged entry


def test_verify_remove_needs_write_access_only_for_something_to_remove(cache_dir, capsys, monkeypatch):
    shards = sorted(str(path) for path in cache_dir.iterdir() if path.is_dir())
    refuse_access(monkeypatch, set(shards), os.W_OK)
    code, out = run(capsys, "cache", "verify", "--remove", "--cache-dir", str(cache_dir))
    assert (code, out) == (0, f"checked 2 entries in {cache_dir}: all valid\n")
    damage(cache_dir, KEY)
    assert error_line(capsys, "cache", "verify", "--remove", "--cache-dir", str(cache_dir)).startswith(
        "sdpagraph cache verify: permission denied: cannot write to")


def test_verify_reports_stale_temp_files_and_removes_them(cache_dir, capsys):
    shard = next(path for path in cache_dir.iterdir() if path.is_dir())
    stale, fresh = shard / ("a" * 64 + ".x1.tmp"), shard / ("b" * 64 + ".x2.tmp")
    stale.write_bytes(b"half an entry")
    fresh.write_bytes(b"being written")
    two_hours_ago = os.stat(stale).st_mtime - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    code, out = run(capsys, "cache", "verify", "--cache-dir", str(cache_dir))
    assert code == 0 and out.splitlines() == [
        f"checked 2 entries in {cache_dir}: all valid",
        "1 stale temp file, left by killed writers (never read; `sdpagraph cache verify --remove` deletes them)"]
    code, data = run_json(capsys, "cache", "verify", "--cache-dir", str(cache_dir))
    assert code == 0 and data["stale_temp_files"] == [str(stale)] and stale.exists()
    code, out = run(capsys, "cache", "verify", "--remove", "--cache-dir", str(cache_dir))
    assert code == 0 and out.splitlines()[-1] == "1 stale temp file, left by killed writers: 1 removed"
    assert not stale.exists() and fresh.exists()  # a fresh one may belong to a live writer


@pytest.mark.parametrize("action", ACTIONS)
def test_a_directory_this_user_cannot_read_is_an_error(cache_dir, capsys, monkeypatch, action):
    real_scandir = os.scandir

    def scandir(path="."):
        if os.fspath(path) == str(cache_dir):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert error_line(capsys, "cache", *action, "--cache-dir", str(cache_dir)) == \
        f"sdpagraph cache {action[0]}: permission denied: cannot read {cache_dir}"
    monkeypatch.setattr(os, "scandir", real_scandir)
    shard = sorted(str(path) for path in cache_dir.iterdir() if path.is_dir())[0]
    refuse_access(monkeypatch, {shard}, os.R_OK)
    assert error_line(capsys, "cache", *action, "--cache-dir", str(cache_dir)) == \
        f"sdpagraph cache {action[0]}: permission denied: cannot read {shard}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any directory")
def test_a_read_only_directory_for_real(cache_dir, capsys):
    shards = [path for path in cache_dir.iterdir() if path.is_dir()]
    for shard in shards:
        shard.chmod(0o500)
    try:
        assert "permission denied" in error_line(capsys, "cache", "clear", "--cache-dir", str(cache_dir))
        assert len(list(cache_dir.rglob("*.sdpg"))) == 2
    finally:
        for shard in shards:
            shard.chmod(0o700)


def test_usage_errors_return_2(capsys):
    assert cli.main(["cache", "prune", "--max-bytes", "lots"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--max-bytes must be a byte count" in err
    assert cli.main(["cache"]) == 2
    assert cli.main([]) == 2


def test_clear_keeps_what_another_process_is_publishing(cache_dir, capsys):
    publisher = DiskStore(cache_dir, writable=True, lock_timeout_s=1)
    with publisher.key_lock(KEY.digest()):
        code, data = run_json(capsys, "cache", "clear", "--cache-dir", str(cache_dir))
    assert code == 0 and (data["removed"], data["in_use"], data["lock_files_removed"]) == (1, 1, 1)
    assert GraphCache(cache_dir).entry_path(KEY) and os.path.exists(publisher.lock_path(KEY.digest()))
    assert GraphCache(cache_dir).entry_path("plain key") is None
