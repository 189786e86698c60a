"""Task record: round trips, foreign (SWE-bench style) records, bad input, atomic save, workspaces."""

import io
import json
import os
import re
import tarfile
from pathlib import Path

import pytest

from etude.tasks import record as record_mod
from etude.tasks.record import (
    EtudeInfo,
    TaskRecord,
    archive_workspace,
    load_tasks,
    resolve_workspace,
    save_tasks,
    tree_digest,
)


def make_record(instance_id="pkg__mod.func", workspace="workspaces/pkg__mod.func", **kwargs):
    fields = dict(
        instance_id=instance_id,
        repo="pkg",
        base_commit="sha256:" + "0" * 64,
        patch="diff --git a/pkg/mod.py b/pkg/mod.py\n--- a/pkg/mod.py\n+++ b/pkg/mod.py\n",
        problem_statement="Implement `func` in `pkg/mod.py`.\n",
        version="1.0",
        FAIL_TO_PASS=["tests/test_mod.py::test_func[a-1]"],
        PASS_TO_PASS=["tests/test_mod.py::test_other"],
        etude=EtudeInfo(
            kind="feature_deletion",
            workspace=workspace,
            symbols=["pkg.mod.func", "pkg.mod._helper"],
            difficulty={"deleted_lines": 12, "num_symbols": 2},
            leak_scan={"clean": True, "files_scanned": 9},
            detail_level="docstring",
            hidden_paths=["docs/api"],
        ),
    )
    fields.update(kwargs)
    return TaskRecord(**fields)


# A SWE-bench instance as the dataset ships it: test lists as JSON-encoded strings, extra keys.
SWE_BENCH_ROW = {
    "repo": "example-org/widgets",
    "instance_id": "example-org__widgets-1234",
    "base_commit": "3f2a9c0d8b7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a",
    "patch": "diff --git a/widgets/core.py b/widgets/core.py\n",
    "test_patch": "diff --git a/tests/test_core.py b/tests/test_core.py\n",
    "problem_statement": "Resizing a widget to zero width crashes.\n",
    "hints_text": "",
    "created_at": "2023-04-01T12:00:00Z",
    "version": "3.0",
    "FAIL_TO_PASS": '["tests/test_core.py::test_zero_width"]',
    "PASS_TO_PASS": '["tests/test_core.py::test_resize", "tests/test_core.py::test_draw"]',
    "environment_setup_commit": "aa11bb22cc33dd44ee55ff66aa11bb22cc33dd44",
}

# SWE-smith style: lists, no test_patch/version/hints, an image name the format adds.
SWE_SMITH_ROW = {
    "instance_id": "example-org__widgets.3f2a9c0d.func_pm_remove_cond__x1",
    "repo": "swesmith/example-org__widgets.3f2a9c0d",
    "patch": "diff --git a/widgets/core.py b/widgets/core.py\n",
    "FAIL_TO_PASS": ["tests/test_core.py::test_zero_width"],
    "PASS_TO_PASS": ["tests/test_core.py::test_resize"],
    "created_at": "2024-11-02T08:30:00",
    "image_name": "swesmith.x86_64.example-org__widgets.3f2a9c0d",
    "base_commit": "3f2a9c0d8b7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a",
    "problem_statement": "",
}


class TestRoundTrip:
    def test_json_round_trip(self):
        rec = make_record(extra={"source_sha": "abc"})
        line = rec.to_json()
        assert "\n" not in line and line.isascii()
        assert TaskRecord.from_json(line) == rec

    def test_on_disk_key_order(self):
        keys = list(make_record(extra={"source_sha": "abc"}).to_dict())
        assert keys[0] == "instance_id"
        assert keys.index("FAIL_TO_PASS") < keys.index("source_sha") < keys.index("etude")
        assert keys[-1] == "etude"
        # Optional SWE-bench fields left unset are not written.
        assert "hints_text" not in keys and "created_at" not in keys

    def test_unknown_keys_kept_at_both_levels(self):
        data = make_record().to_dict()
        data["grader"] = {"timeout": 30}
        data["etude"]["seed"] = 7
        rec = TaskRecord.from_dict(data)
        assert rec.extra == {"grader": {"timeout": 30}}
        assert rec.etude.extra == {"seed": 7}
        assert rec.to_dict() == data

    def test_save_load_round_trip(self, tmp_path):
        records = [
            make_record(f"pkg__t{i}", f"workspaces/t{i}", problem_statement=f"Caf\u00e9 {i}\n")
            for i in range(3)
        ]
        path = save_tasks(tmp_path / "out" / "tasks.jsonl", records)
        text = path.read_text()
        assert text.endswith("\n") and len(text.splitlines()) == 3 and text.isascii()
        assert load_tasks(path) == records
        assert load_tasks(tmp_path / "out") == records  # a directory means DIR/tasks.jsonl

    def test_bare_number_difficulty_becomes_score(self):
        data = make_record().to_dict()
        data["etude"]["difficulty"] = 0.25
        assert TaskRecord.from_dict(data).etude.difficulty == {"score": 0.25}


class TestForeignRecords:
    def test_swe_bench_row_loads(self):
        rec = TaskRecord.from_dict(SWE_BENCH_ROW)
        assert rec.etude is None
        assert rec.FAIL_TO_PASS == ["tests/test_core.py::test_zero_width"]
        assert rec.PASS_TO_PASS == [
            "tests/test_core.py::test_resize",
            "tests/test_core.py::test_draw",
        ]
        assert rec.hints_text == "" and rec.created_at == "2023-04-01T12:00:00Z"
        assert rec.extra == {"environment_setup_commit": SWE_BENCH_ROW["environment_setup_commit"]}

    def test_swe_bench_round_trip_keeps_every_field(self):
        out = TaskRecord.from_dict(SWE_BENCH_ROW).to_dict()
        assert set(out) == set(SWE_BENCH_ROW)
        for key, value in SWE_BENCH_ROW.items():
            if key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
                assert out[key] == json.loads(value)  # written back as lists
            else:
                assert out[key] == value

    def test_swe_smith_row_loads(self):
        rec = TaskRecord.from_dict(SWE_SMITH_ROW)
        assert rec.test_patch == "" and rec.version == "" and rec.hints_text is None
        assert rec.extra == {"image_name": SWE_SMITH_ROW["image_name"]}
        assert TaskRecord.from_dict(rec.to_dict()) == rec

    def test_numeric_version_and_null_lists(self):
        row = dict(SWE_BENCH_ROW, version=0.4, PASS_TO_PASS=None)
        rec = TaskRecord.from_dict(row)
        assert rec.version == "0.4" and rec.PASS_TO_PASS == []

    def test_file_of_foreign_rows_loads(self, tmp_path):
        path = tmp_path / "swe.jsonl"
        path.write_text(json.dumps(SWE_BENCH_ROW) + "\n\n" + json.dumps(SWE_SMITH_ROW) + "\n")
        ids = [r.instance_id for r in load_tasks(path)]
        assert ids == [SWE_BENCH_ROW["instance_id"], SWE_SMITH_ROW["instance_id"]]

    def test_foreign_record_has_no_workspace(self, tmp_path):
        with pytest.raises(ValueError, match="no etude.workspace"):
            resolve_workspace(TaskRecord.from_dict(SWE_BENCH_ROW), tmp_path)


class TestBadInput:
    def test_malformed_line_names_file_and_line(self, tmp_path):
        path = tmp_path / "tasks.jsonl"
        path.write_text(make_record().to_json() + "\n\n" + '{"instance_id": "x", \n')
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:3: not valid JSON"):
            load_tasks(path)

    @pytest.mark.parametrize(
        "line, message",
        [
            ("[1, 2]", "must be a JSON object"),
            ('{"repo": "pkg"}', "no 'instance_id'"),
            ('{"instance_id": "x", "FAIL_TO_PASS": "not json"}', "FAIL_TO_PASS"),
            ('{"instance_id": "x", "etude": {"kind": "feature_deletion"}}', "workspace"),
        ],
    )
    def test_invalid_record_names_line(self, tmp_path, line, message):
        path = tmp_path / "tasks.jsonl"
        path.write_text(make_record().to_json() + "\n" + line + "\n")
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:2: .*{message}"):
            load_tasks(path)

    def test_duplicate_ids_name_both_lines(self, tmp_path):
        path = tmp_path / "tasks.jsonl"
        line = make_record().to_json()
        path.write_text(f"{line}\n{line}\n")
        with pytest.raises(
            ValueError, match=rf"{re.escape(str(path))}:2: .*already used on line 1"
        ):
            load_tasks(path)

    def test_missing_file(self, tmp_path):
        with pytest.raises(ValueError, match="does not exist"):
            load_tasks(tmp_path / "nope.jsonl")

    @pytest.mark.parametrize(
        "etude_changes, message",
        [
            ({"kind": "mystery"}, "etude.kind"),
            ({"detail_level": "verbose"}, "etude.detail_level"),
            ({"hidden_paths": ["../outside"]}, r"etude.hidden_paths\[0\]"),
            ({"deleted_files": ["/abs/mod.py"]}, r"etude.deleted_files\[0\]"),
            ({"difficulty": {"lines": "many"}}, "etude.difficulty"),
            ({"parent": ""}, "etude.parent"),
            ({"workspace": ""}, "etude.workspace"),
            ({"leak_scan": ["clean"]}, "etude.leak_scan"),
            ({"extra": {"kind": "x"}}, "etude.extra"),
        ],
    )
    def test_bad_etude_fields(self, etude_changes, message):
        fields = make_record().etude.to_dict()
        fields.update(etude_changes)
        with pytest.raises(ValueError, match=message):
            EtudeInfo(**fields)

    @pytest.mark.parametrize(
        "changes, message",
        [
            ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS is empty"),
            ({"PASS_TO_PASS": ["tests/test_mod.py::test_func[a-1]"]}, "in both"),
            ({"FAIL_TO_PASS": "tests/test_mod.py::test_func"}, "FAIL_TO_PASS must be a list"),
            ({"instance_id": ""}, "instance_id"),
            ({"version": 3}, "version"),
            ({"extra": {"repo": "other"}}, "extra repeats"),
        ],
    )
    def test_bad_record_fields(self, changes, message):
        with pytest.raises(ValueError, match=message):
            make_record(**changes)


class TestAtomicSave:
    def test_rename_sees_complete_temp_and_old_target(self, tmp_path, monkeypatch):
        path = tmp_path / "tasks.jsonl"
        old = [make_record("old")]
        new = [make_record(f"new{i}") for i in range(4)]
        save_tasks(path, old)
        old_bytes = path.read_bytes()
        seen = {}
        real_replace = os.replace

        def observing_replace(src, dst):
            seen["tmp"] = Path(src).read_text()
            seen["target"] = Path(dst).read_bytes()
            seen["same_dir"] = Path(src).parent == Path(dst).parent
            real_replace(src, dst)

        monkeypatch.setattr(record_mod.os, "replace", observing_replace)
        save_tasks(path, new)
        assert seen["target"] == old_bytes
        assert seen["tmp"] == "".join(r.to_json() + "\n" for r in new)
        assert seen["same_dir"]
        assert load_tasks(path) == new

    def test_failed_write_leaves_old_file_and_no_temp(self, tmp_path, monkeypatch):
        path = tmp_path / "tasks.jsonl"
        save_tasks(path, [make_record("old")])
        before = path.read_bytes()

        def crash(src, dst):
            raise OSError("disk gone")

        monkeypatch.setattr(record_mod.os, "replace", crash)
        with pytest.raises(OSError, match="disk gone"):
            save_tasks(path, [make_record("new")])
        assert path.read_bytes() == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks.jsonl"]

    def test_duplicate_ids_write_nothing(self, tmp_path):
        path = tmp_path / "tasks.jsonl"
        with pytest.raises(ValueError, match="appears twice"):
            save_tasks(path, [make_record("a"), make_record("a")])
        assert not path.exists()


def build_tree(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text('"""pkg."""\n')
    (root / "pkg" / "mod.py").write_text("def other():\n    return 1\n")
    script = root / "run.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    (root / "docs").mkdir()
    (root / "docs" / "index.md").symlink_to("../pkg/mod.py")
    return root


class TestWorkspaces:
    def test_directory_workspace_relative_to_base_dir(self, tmp_path):
        ws = build_tree(tmp_path / "tasks" / "workspaces" / "pkg__mod.func")
        rec = make_record()
        assert resolve_workspace(rec, tmp_path / "tasks") == ws.absolute()

    def test_missing_directory(self, tmp_path):
        with pytest.raises(ValueError, match="relative to the directory holding the task file"):
            resolve_workspace(make_record(), tmp_path)

    def test_archive_round_trip_preserves_tree(self, tmp_path):
        src = build_tree(tmp_path / "src")
        archive = archive_workspace(src, tmp_path / "tasks" / "ws.tar.gz")
        rec = make_record(workspace="ws.tar.gz")
        out = resolve_workspace(rec, tmp_path / "tasks", dest=tmp_path / "episode")
        assert out == (tmp_path / "episode").absolute()
        assert tree_digest(out) == tree_digest(src)
        assert os.access(out / "run.sh", os.X_OK)
        assert (out / "docs" / "index.md").is_symlink()
        assert archive.name == "ws.tar.gz"

    def test_archive_needs_empty_dest(self, tmp_path):
        archive_workspace(build_tree(tmp_path / "src"), tmp_path / "ws.tgz")
        rec = make_record(workspace="ws.tgz")
        with pytest.raises(ValueError, match="pass dest="):
            resolve_workspace(rec, tmp_path)
        busy = tmp_path / "busy"
        busy.mkdir()
        (busy / "file").write_text("x")
        with pytest.raises(ValueError, match="new or empty directory"):
            resolve_workspace(rec, tmp_path, dest=busy)

    def test_archive_is_reproducible(self, tmp_path):
        src = build_tree(tmp_path / "src")
        first = archive_workspace(src, tmp_path / "a.tar.gz").read_bytes()
        os.utime(src / "pkg" / "mod.py", (1, 1))
        assert archive_workspace(src, tmp_path / "b.tar.gz").read_bytes() == first
        (src / "pkg" / "mod.py").write_text("def other():\n    return 2\n")
        assert archive_workspace(src, tmp_path / "c.tar.gz").read_bytes() != first

    @pytest.mark.parametrize(
        "member, linkname",
        [("../escape.py", None), ("/abs/escape.py", None), ("link", "../../etc/passwd")],
        ids=["dotdot", "absolute", "symlink-out"],
    )
    def test_archive_escape_refused(self, tmp_path, member, linkname):
        archive = tmp_path / "evil.tar"
        with tarfile.open(archive, "w") as tar:
            info = tarfile.TarInfo(member)
            if linkname is None:
                payload = b"print('owned')\n"
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            else:
                info.type = tarfile.SYMTYPE
                info.linkname = linkname
                tar.addfile(info)
        rec = make_record(workspace=str(archive))
        with pytest.raises(ValueError, match="outside its root"):
            resolve_workspace(rec, tmp_path, dest=tmp_path / "dest" / "ws")
        assert not (tmp_path / "dest" / "escape.py").exists()
        assert not (tmp_path / "escape.py").exists()


class TestTreeDigest:
    def test_content_mode_and_names_count_mtime_does_not(self, tmp_path):
        root = build_tree(tmp_path / "t")
        digest = tree_digest(root)
        assert digest.startswith("sha256:") and len(digest) == 7 + 64
        os.utime(root / "pkg" / "mod.py", (5, 5))
        (root / "empty").mkdir()
        assert tree_digest(root) == digest
        (root / "run.sh").chmod(0o644)
        assert tree_digest(root) != digest
        (root / "run.sh").chmod(0o755)
        assert tree_digest(root) == digest
        (root / "pkg" / "mod.py").rename(root / "pkg" / "mod2.py")
        assert tree_digest(root) != digest
