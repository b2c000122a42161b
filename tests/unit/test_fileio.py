"""Outputs published whole, and the one rule for outputs that already exist."""

from __future__ import annotations

import pytest

from megatron_ext.fileio import publish_dir, staged_dir, staged_file, write_atomic, write_files


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.txt"
    write_atomic(target, "old")
    with pytest.raises(RuntimeError, match="stopped"):
        with staged_file(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("stopped")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new" and oct(target.stat().st_mode & 0o777) == "0o644"


def test_identical_outputs_are_left_alone_and_different_ones_need_overwrite(tmp_path):
    files = {tmp_path / "a.jsonl": b"1\n", tmp_path / "sub" / "task.json": b"{}\n"}
    assert write_files(files, overwrite=False) is True
    before = {path: path.stat().st_mtime_ns for path in files}
    assert write_files(files, overwrite=False) is False  # nothing written
    assert {path: path.stat().st_mtime_ns for path in files} == before
    changed = {**files, tmp_path / "a.jsonl": b"2\n"}
    with pytest.raises(ValueError, match=r"files that differ: .*a\.jsonl\); pass --overwrite"):
        write_files(changed, overwrite=False)
    assert (tmp_path / "a.jsonl").read_bytes() == b"1\n"
    assert write_files(changed, overwrite=True) is True
    assert (tmp_path / "a.jsonl").read_bytes() == b"2\n"


def test_a_directory_is_published_in_one_rename(tmp_path):
    target = tmp_path / "model"

    def publish(content: str, **kwargs) -> str:
        with staged_dir(target) as tmp:
            (tmp / "config.json").write_text(content)
            return publish_dir(tmp, target, **kwargs)

    assert publish("a", overwrite=False, identical_ok=True) == "created"
    assert publish("a", overwrite=False, identical_ok=True) == "unchanged"
    with pytest.raises(ValueError, match=r"already holds a different model \(files that differ: config.json\)"):
        publish("b", overwrite=False, identical_ok=True)
    assert (target / "config.json").read_text() == "a"
    assert publish("b", overwrite=True, identical_ok=True) == "replaced"
    assert (target / "config.json").read_text() == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging or old trees left
