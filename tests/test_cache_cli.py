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


@pytest.mark.parametrize("action", [["ls"], ["verify"], ["prune", "--max-bytes", "0"], ["clear"]])
def test_missing_directory_is_reported_not_created(tmp_path, capsys, action):
    code, out = run(capsys, "cache", *action, "--cache-dir", str(tmp_path / "absent"))
    assert code == 0 and out == f"no cache directory at {tmp_path / 'absent'}\n"
    assert not (tmp_path / "absent").exists()


def test_usage_errors_return_2(capsys):
    assert cli.main(["cache", "prune", "--max-bytes", "lots"]) == 2
    assert "--max-bytes must be a byte count" in capsys.readouterr().err
    assert cli.main(["cache"]) == 2
    assert cli.main([]) == 2


def test_clear_keeps_what_another_process_is_publishing(cache_dir, capsys):
    publisher = DiskStore(cache_dir, writable=True, lock_timeout_s=1)
    with publisher.key_lock(KEY.digest()):
        code, data = run_json(capsys, "cache", "clear", "--cache-dir", str(cache_dir))
    assert code == 0 and (data["removed"], data["in_use"], data["lock_files_removed"]) == (1, 1, 1)
    assert GraphCache(cache_dir).entry_path(KEY) and os.path.exists(publisher.lock_path(KEY.digest()))
    assert GraphCache(cache_dir).entry_path("plain key") is None
