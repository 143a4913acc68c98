"""The patch engine and install/verify/revert on small git repositories made here (no upstream needed).

A fake upstream repository stands in for ComfyUI and a fake h3kit checkout (H3KIT_ROOT) holds a two-patch
series, a new-file source under patches/src, and shipped files, so every edge case runs in milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys

import pytest

from h3kit.cli import main
from tests.support.fakekit import (A_PY, NEW_PY, NODES_PY, P1, P2, commit_change, git, h3, install, kit,  # noqa: F401
                                   payload, refreshed, snapshot, upstream)


# --- series maintenance ----------------------------------------------------------------------------

def test_refresh_records_sha_and_base_blobs(refreshed, upstream):
    up, pin = upstream
    data = json.loads((refreshed / "source_deps_info.json").read_text())
    assert [p["name"] for p in data["patches"]] == ["p1-change-a.patch", "p2-change-nodes.patch"]
    files = {f["path"]: f for f in data["patches"][0]["files"]}
    assert files["comfy/a.py"]["base_blob"] == git("rev-parse", f"{pin}:comfy/a.py", cwd=up)
    assert files["comfy/new.py"] == {"path": "comfy/new.py", "status": "added", "base_blob": None}
    assert "+def hello():" in (refreshed / "patches" / "p1-change-a.patch").read_text()


def test_refresh_writes_index_lines_and_check_compares_them_with_the_pin(refreshed, upstream, runner, tmp_path):
    up, pin = upstream
    text = (refreshed / "patches" / "p1-change-a.patch").read_text()
    # the base and new blobs of each section, as git diff --full-index writes them
    work = tmp_path / "work"
    git("clone", "-q", str(up), str(work), cwd=tmp_path)
    git("apply", str(refreshed / "patches" / "p1-change-a.patch"), cwd=work)
    assert (f"diff --git a/comfy/a.py b/comfy/a.py\nindex {git('rev-parse', f'{pin}:comfy/a.py', cwd=up)}.."
            f"{git('hash-object', 'comfy/a.py', cwd=work)} 100644\n") in text
    assert ("new file mode 100644\nindex " + "0" * 40 + ".." + git("hash-object", "comfy/new.py", cwd=work)) in text
    assert h3(runner, "patches", "check", "--source", up).exit_code == 0
    # a base that is not the pin's blob, then no index line at all: both named, with the fix
    (refreshed / "patches" / "p1-change-a.patch").write_text(text.replace(git("rev-parse", f"{pin}:comfy/a.py", cwd=up),
                                                                          "1" * 40))
    h3(runner, "patches", "refresh", "--source", up)  # refresh puts the right line back
    assert (refreshed / "patches" / "p1-change-a.patch").read_text() == text
    data = json.loads((refreshed / "source_deps_info.json").read_text())
    bad = text.replace(git("rev-parse", f"{pin}:comfy/a.py", cwd=up), "1" * 40)
    (refreshed / "patches" / "p1-change-a.patch").write_text(bad)
    data["patches"][0]["sha256"] = hashlib.sha256(bad.encode()).hexdigest()
    (refreshed / "source_deps_info.json").write_text(json.dumps(data))
    r = h3(runner, "patches", "check", "--source", up)
    assert r.exit_code == 1 and "p1-change-a.patch: comfy/a.py: index line 111111111111.." in r.output, r.output
    (refreshed / "patches" / "p2-change-nodes.patch").write_text(P2)
    r = h3(runner, "patches", "check")
    assert r.exit_code == 1 and "p2-change-nodes.patch: nodes.py: no index line" in r.output


def test_check_names_a_hook_that_imports_a_package_inside_a_function(refreshed, upstream, runner):
    # `import comfy.x` in a function body makes `comfy` local to all of it: an earlier comfy.* use then raises
    # UnboundLocalError at run time (main.py's start_comfyui did, once its hook imported at its use)
    up, _ = upstream
    hook = P2.replace("@@ -1,6 +1,6 @@", "@@ -1,7 +1,8 @@") + "+    import os.path\n     return NODES\n"
    (refreshed / "patches" / "p2-change-nodes.patch").write_text(hook)
    h3(runner, "patches", "refresh", "--source", up)
    r = h3(runner, "patches", "check", "--source", up)
    assert r.exit_code == 1
    assert "p2-change-nodes.patch: nodes.py: load() gains 'import os.path', which makes 'os' a local name" in r.output
    assert "write 'from os import path'" in r.output
    (refreshed / "patches" / "p2-change-nodes.patch").write_text(hook.replace("import os.path", "from os import path"))
    h3(runner, "patches", "refresh", "--source", up)
    assert h3(runner, "patches", "check", "--source", up).exit_code == 0


def test_check_passes_then_flags_each_structural_problem(refreshed, upstream, runner):
    up, _ = upstream
    assert h3(runner, "patches", "check", "--source", up).exit_code == 0
    # a source edited without refresh: the generated section drifts
    (refreshed / "patches" / "src" / "comfy" / "new.py").write_text(NEW_PY + "# edited\n")
    r = h3(runner, "patches", "check", "--source", up)
    assert r.exit_code == 1 and "differ from patches/src" in r.output
    (refreshed / "patches" / "src" / "comfy" / "new.py").write_text(NEW_PY)
    # an orphan patch file and an orphan source
    (refreshed / "patches" / "orphan.patch").write_text(P2)
    (refreshed / "patches" / "src" / "comfy" / "lonely.py").write_text("x = 1\n")
    r = h3(runner, "patches", "check", "--source", up)
    assert "orphan.patch is in patches/ but not in patches/series" in r.output
    assert "patches/src/comfy/lonely.py is added by no patch" in r.output
    assert r.exit_code == 1


def test_missing_dep3_field_is_a_clear_error(refreshed, runner):
    (refreshed / "patches" / "p2-change-nodes.patch").write_text(P2.replace("Forwarded: not-needed\n", ""))
    r = runner.invoke(main, ["patches", "check"])
    assert r.exit_code == 1
    assert "DEP-3 header lacks Forwarded" in r.output
    assert "Traceback" not in r.output


def test_edited_patch_no_longer_matches_manifest(refreshed, upstream, runner):
    up, _ = upstream
    text = (refreshed / "patches" / "p2-change-nodes.patch").read_text()
    (refreshed / "patches" / "p2-change-nodes.patch").write_text(text.replace("'multinpu'", "'other'"))
    r = h3(runner, "patches", "check", "--source", up)
    assert r.exit_code == 1 and "sha256 differs" in r.output


# --- install ---------------------------------------------------------------------------------------

def test_clean_install_then_rerun_changes_nothing(refreshed, upstream, runner, tmp_path):
    up, pin = upstream
    home = tmp_path / "home"
    r = install(runner, home, "--source", up)
    assert r.exit_code == 0, r.output
    rep = payload(r)
    assert rep["cloned"] and [p["state"] for p in rep["patches"]] == ["apply", "apply"]
    assert (home / "comfy" / "a.py").read_text() == A_PY.replace("line 7\n", "line seven\n")
    assert (home / "comfy" / "new.py").read_text() == NEW_PY
    assert "'multinpu'" in (home / "nodes.py").read_text()
    assert (home / "custom_nodes" / "h3kit_test" / "__init__.py").read_text() == "NODE = 1\n"
    assert (home / "user/default/workflows/h3kit/w.json").is_file()
    launch = home / ".h3kit" / "run" / "start.sh"
    assert launch.stat().st_mode & stat.S_IXUSR
    state = json.loads((home / ".h3kit" / "state.json").read_text())
    assert state["pin"] == pin and len(state["files"]) == 3 and state["python"] == sys.executable
    assert "/.h3kit/" in (home / ".git" / "info" / "exclude").read_text()
    assert git("status", "--porcelain", cwd=home).splitlines() == [
        " M comfy/a.py", " M nodes.py", "?? comfy/new.py", "?? custom_nodes/", "?? user/"]

    before = snapshot(home)
    r = install(runner, home, "--source", up)
    assert r.exit_code == 0
    rep = payload(r)
    assert [p["state"] for p in rep["patches"]] == ["applied", "applied"] and rep["changed"] == []
    after = snapshot(home)
    assert {k: v for k, v in after.items() if not k.startswith(".h3kit/")} == \
           {k: v for k, v in before.items() if not k.startswith(".h3kit/")}


def test_a_write_that_fails_midway_restores_every_file(refreshed, upstream, runner, tmp_path):
    """All or nothing also when the disk says no: comfy/a.py is written first, then comfy/new.py cannot be
    (a folder stands in its way), and a.py must be back as it was."""
    up, _ = upstream
    home = tmp_path / "home"
    git("clone", "-q", str(up), str(home), cwd=tmp_path)
    (home / "comfy" / "new.py").mkdir()
    (home / "comfy" / "new.py" / "keep").write_text("in the way\n")
    before = snapshot(home)
    r = install(runner, home, "--source", up)
    assert r.exit_code == 1
    err = payload(r)["error"]
    assert err["code"] == "write_failed" and "every file was restored" in err["message"]
    assert snapshot(home) == before
    assert not (home / ".h3kit" / "state.json").exists()


def test_a_file_that_cannot_be_restored_is_named(tmp_path, monkeypatch):
    """If even the restore fails (a file the user cannot write), the error says which file, not 'restored'."""
    from h3kit import patches as engine

    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "a.py").write_text("a0\n")
    (tree / "b.py").write_text("b0\n")
    real_replace = os.replace

    def replace(src, dst):
        name = os.path.basename(dst)
        if name == "b.py" or str(src).endswith(".h3kit-restore"):
            raise PermissionError(13, "Permission denied", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(engine.os, "replace", replace)
    before = {"a.py": b"a0\n", "b.py": b"b0\n"}
    with pytest.raises(PermissionError) as e:
        engine.write_tree_files(tree, before, {"a.py": b"a1\n", "b.py": b"b1\n"})
    assert e.value.h3kit_not_restored == ["a.py"]
    assert (tree / "b.py").read_text() == "b0\n"


def test_install_purges_bytecode_under_the_patched_folders(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "home"
    git("clone", "-q", str(up), str(home), cwd=tmp_path)
    stale = home / "comfy" / "__pycache__" / "a.cpython-311.pyc"
    stale.parent.mkdir()
    stale.write_bytes(b"old bytecode")
    rep = payload(install(runner, home, "--source", up))
    assert "comfy/__pycache__" in rep["purged_bytecode"] and not stale.exists()


def test_verify_passes_then_reports_each_problem(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "home"
    assert install(runner, home, "--source", up).exit_code == 0
    r = h3(runner, "verify", "--comfy-home", home)
    assert r.exit_code == 0, r.output
    (home / "comfy" / "a.py").write_text(A_PY)  # patch 1 undone by hand
    (home / "custom_nodes" / "h3kit_test" / "__init__.py").write_text("NODE = 2\n")
    pyc = home / "comfy" / "__pycache__" / "new.cpython-311.pyc"
    pyc.parent.mkdir()
    pyc.write_bytes(b"\x00" * 8 + b"\x01\x00\x00\x00" + b"\x05\x00\x00\x00")  # compiled from another version
    r = h3(runner, "verify", "--comfy-home", home, "--json")
    assert r.exit_code == 1
    problems = "\n".join(payload(r)["problems"])
    assert "patch p1-change-a.patch is not applied" in problems
    assert "comfy/a.py differs from what the series produces" in problems
    assert "installed file custom_nodes/h3kit_test/__init__.py was modified" in problems
    assert "stale bytecode: comfy/__pycache__/new.cpython-311.pyc" in problems


def test_already_applied_patch_is_detected(refreshed, upstream, runner, tmp_path):
    up, pin = upstream
    home = tmp_path / "home"
    git("clone", "-q", str(up), str(home), cwd=tmp_path)
    subprocess.run(["git", "apply", str(refreshed / "patches" / "p2-change-nodes.patch")], cwd=home, check=True)
    r = install(runner, home, "--source", up)
    assert r.exit_code == 0, r.output
    assert [p["state"] for p in payload(r)["patches"]] == ["apply", "applied"]


def test_local_edit_refused_tree_unchanged_and_hunk_named(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "home"
    git("clone", "-q", str(up), str(home), cwd=tmp_path)
    (home / "nodes.py").write_text(NODES_PY.replace("['a', 'b']", "['a', 'b', 'mine']"))
    before = snapshot(home)
    r = install(runner, home, "--source", up)
    assert r.exit_code == 1
    err = payload(r)["error"]
    assert err["code"] == "install_refused" and "nodes.py" in err["message"]
    p2 = next(p for p in err["details"]["patches"] if p["patch"] == "p2-change-nodes.patch")
    assert p2["state"] == "conflict"
    assert p2["failures"][0]["file"] == "nodes.py" and p2["failures"][0]["hunk"].startswith("@@ -1,6 +1,6 @@")
    assert snapshot(home) == before
    # --force restores the file from the pin, then patches
    r = install(runner, home, "--source", up, "--force")
    assert r.exit_code == 0, r.output
    assert payload(r)["discarded_edits"] == ["nodes.py"]
    assert "'multinpu'" in (home / "nodes.py").read_text()


def test_series_that_does_not_apply_leaves_nothing_behind(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    broken = P1.replace(" line 5\n", " line five\n")
    (refreshed / "patches" / "p1-change-a.patch").write_text(broken)
    home = tmp_path / "home"
    home.mkdir()
    r = install(runner, home, "--source", up)
    assert r.exit_code == 1
    err = payload(r)["error"]
    assert err["code"] == "patch_conflict"
    assert "p1-change-a.patch: comfy/a.py hunk @@ -4,7 +4,7 @@" in err["message"]
    assert home.is_dir() and list(home.iterdir()) == []  # the clone this run made is gone


def test_upstream_drift_is_reported_precisely(refreshed, upstream, runner, tmp_path):
    up, pin = upstream
    later = commit_change(up, "comfy/a.py", A_PY.replace("line 18\n", "line eighteen\n"))
    home = tmp_path / "home"
    r = install(runner, home, "--source", up, "--commit", later, "--force")
    assert r.exit_code == 0, r.output  # the change is outside every hunk: the series still applies
    drift = payload(r)["drift"]
    assert drift == [{"patch": "p1-change-a.patch", "file": "comfy/a.py",
                      "expected_base": git("rev-parse", f"{pin}:comfy/a.py", cwd=up),
                      "found": git("rev-parse", f"{later}:comfy/a.py", cwd=up), "kind": "upstream"}]
    # a later commit inside a hunk: conflict naming the hunk, drift in the details
    clash = commit_change(up, "comfy/a.py", A_PY.replace("line 7\n", "line VII\n"))
    r = install(runner, tmp_path / "home2", "--source", up, "--commit", clash, "--force")
    assert r.exit_code == 1
    err = payload(r)["error"]
    assert "hunk @@ -4,7 +4,7 @@" in err["message"] and err["details"]["drift"][0]["file"] == "comfy/a.py"


def test_other_commit_refused_without_force(refreshed, upstream, runner, tmp_path):
    up, pin = upstream
    later = commit_change(up, "comfy/a.py", A_PY.replace("line 18\n", "line eighteen\n"))
    home = tmp_path / "home"
    git("clone", "-q", str(up), str(home), cwd=tmp_path)
    assert git("rev-parse", "HEAD", cwd=home) == later
    r = install(runner, home, "--source", up)
    assert r.exit_code == 1 and payload(r)["error"]["code"] == "install_refused"
    assert "not the pin" in payload(r)["error"]["message"]
    r = install(runner, home, "--source", up, "--force")
    assert r.exit_code == 0, r.output
    assert git("rev-parse", "HEAD", cwd=home) == pin


def test_user_edited_installed_file_is_kept_unless_force(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "home"
    assert install(runner, home, "--source", up).exit_code == 0
    wf = home / "user/default/workflows/h3kit/w.json"
    wf.write_text('{"nodes": [1]}\n')
    (refreshed / "workflows" / "w.json").write_text('{"nodes": [], "v": 2}\n')  # a newer h3kit ships a new version
    r = install(runner, home, "--source", up)
    assert r.exit_code == 0
    rep = payload(r)
    assert rep["files"]["kept"] == ["user/default/workflows/h3kit/w.json"]
    assert any("kept files you edited" in w for w in rep["warnings"])
    assert wf.read_text() == '{"nodes": [1]}\n'
    r = install(runner, home, "--source", up)  # still kept on the next run: it is still the user's
    assert payload(r)["files"]["kept"] == ["user/default/workflows/h3kit/w.json"]
    r = install(runner, home, "--source", up, "--force")
    assert payload(r)["files"]["overwritten"] == ["user/default/workflows/h3kit/w.json"]
    assert wf.read_text() == '{"nodes": [], "v": 2}\n'


def test_preexisting_user_file_is_never_taken_over(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "home"
    git("clone", "-q", str(up), str(home), cwd=tmp_path)
    own = home / "custom_nodes" / "h3kit_test" / "__init__.py"
    own.parent.mkdir(parents=True)
    own.write_text("THEIRS = 1\n")
    for _ in range(2):
        rep = payload(install(runner, home, "--source", up))
        assert rep["files"]["kept"] == ["custom_nodes/h3kit_test/__init__.py"]
    assert own.read_text() == "THEIRS = 1\n"
    assert h3(runner, "revert", "--comfy-home", home).exit_code == 0
    assert own.read_text() == "THEIRS = 1\n"


def test_unedited_installed_file_follows_new_h3kit(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "home"
    assert install(runner, home, "--source", up).exit_code == 0
    (refreshed / "launch" / "start.sh").write_text("#!/bin/sh\necho start v2\n")
    (refreshed / "workflows" / "w.json").unlink()
    rep = payload(install(runner, home, "--source", up))
    assert rep["files"]["updated"] == [".h3kit/run/start.sh"]
    assert rep["files"]["removed"] == ["user/default/workflows/h3kit/w.json"]
    assert not (home / "user/default/workflows/h3kit/w.json").exists()


def test_new_series_replaces_the_applied_one(refreshed, upstream, runner, tmp_path):
    """Upgrading h3kit: the old series (kept in .h3kit/applied-patches) is reversed, the new one applied."""
    up, _ = upstream
    home = tmp_path / "home"
    assert install(runner, home, "--source", up).exit_code == 0
    (refreshed / "patches" / "p2-change-nodes.patch").write_text(P2.replace("'multinpu'", "'multinpu', 'v2'"))
    assert h3(runner, "patches", "refresh", "--source", up).exit_code == 0
    r = install(runner, home, "--source", up)
    assert r.exit_code == 0, r.output
    assert "'multinpu', 'v2'" in (home / "nodes.py").read_text()
    assert h3(runner, "verify", "--comfy-home", home).exit_code == 0


def test_added_patch_on_a_shared_file_upgrades_cleanly(refreshed, upstream, runner, tmp_path):
    """A newer series adds a patch to a file an applied patch already changed (comfy/a.py)."""
    up, _ = upstream
    home = tmp_path / "home"
    assert install(runner, home, "--source", up).exit_code == 0
    p3 = P1.replace("Change a.py and add new.py", "Change a.py again").replace(
        "@@ -4,7 +4,7 @@\n line 4\n line 5\n line 6\n-line 7\n+line seven\n line 8\n line 9\n line 10\n",
        "@@ -14,7 +14,7 @@\n line 14\n line 15\n line 16\n-line 17\n+line seventeen\n line 18\n line 19\n line 20\n")
    (refreshed / "patches" / "p3-change-a-again.patch").write_text(p3)
    with (refreshed / "patches" / "series").open("a") as f:
        f.write("p3-change-a-again.patch\n")
    assert h3(runner, "patches", "refresh", "--source", up).exit_code == 0
    r = install(runner, home, "--source", up)
    assert r.exit_code == 0, r.output
    assert [p["state"] for p in payload(r)["patches"]] == ["applied", "applied", "apply"]
    text = (home / "comfy" / "a.py").read_text()
    assert "line seven\n" in text and "line seventeen\n" in text
    assert h3(runner, "verify", "--comfy-home", home).exit_code == 0


def test_dry_run_changes_nothing(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "home"
    r = install(runner, home, "--source", up, "--dry-run")
    assert r.exit_code == 0 and payload(r)["cloned"] and not home.exists()
    git("clone", "-q", str(up), str(home), cwd=tmp_path)
    before = snapshot(home)
    rep = payload(install(runner, home, "--source", up, "--dry-run"))
    assert {"comfy/a.py", "comfy/new.py", "nodes.py", ".h3kit/run/start.sh"} <= set(rep["changed"])
    assert snapshot(home) == before


def test_revert_leaves_git_status_clean_and_keeps_user_files(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "home"
    assert install(runner, home, "--source", up).exit_code == 0
    (home / "custom_nodes" / "h3kit_test" / "__init__.py").write_text("NODE = 'mine'\n")
    r = h3(runner, "revert", "--comfy-home", home, "--json")
    assert r.exit_code == 0, r.output
    rep = payload(r)
    assert [p["state"] for p in rep["patches"]] == ["reverse", "reverse"]
    assert rep["kept"] == ["custom_nodes/h3kit_test/__init__.py"]
    assert git("status", "--porcelain", "--untracked-files=all", cwd=home).splitlines() == \
        ["?? custom_nodes/h3kit_test/__init__.py"]
    assert not (home / "comfy" / "new.py").exists()
    assert not (home / ".h3kit" / "state.json").exists()


def test_revert_of_an_edited_patched_file_needs_force(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "home"
    assert install(runner, home, "--source", up).exit_code == 0
    (home / "nodes.py").write_text("edited by hand\n")
    before = snapshot(home)
    r = h3(runner, "revert", "--comfy-home", home, "--json")
    assert r.exit_code == 1 and payload(r)["error"]["code"] == "patch_conflict"
    assert snapshot(home) == before
    r = h3(runner, "revert", "--comfy-home", home, "--force", "--json")
    assert r.exit_code == 0 and payload(r)["restored_from_pin"] == ["nodes.py"]
    assert git("status", "--porcelain", cwd=home) == ""


def test_non_git_folder_and_bad_commit_are_refused(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine\n")
    r = install(runner, home, "--source", up)
    assert r.exit_code == 1 and "not a git checkout" in payload(r)["error"]["message"]
    assert (home / "notes.txt").read_text() == "mine\n"
    r = runner.invoke(main, ["install", "--comfy-home", str(tmp_path / "x"), "--commit", "--upload-pack=evil"])
    assert r.exit_code == 2 and "is not a revision" in r.output and "Traceback" not in r.output


def test_missing_source_is_a_clear_error(refreshed, runner, tmp_path):
    r = install(runner, tmp_path / "home", "--source", tmp_path / "nowhere")
    assert r.exit_code == 1
    assert payload(r)["error"]["code"] == "no_source"
    assert not (tmp_path / "home").exists()


def test_clone_shows_gits_progress_and_names_a_failed_source(upstream, tmp_path, capsys):
    from h3kit import gitutil

    up, pin = upstream
    gitutil.clone_no_checkout(f"file://{up}", tmp_path / "c", progress=True)  # file:// makes git transfer objects
    shown = capsys.readouterr().err
    assert "\r  Receiving objects: 100%" in shown and shown.endswith("\n"), shown
    assert gitutil.has_commit(tmp_path / "c", pin) and not (tmp_path / "c" / "comfy").exists()  # no checkout
    with pytest.raises(gitutil.GitError) as e:
        gitutil.clone_no_checkout(f"file://{tmp_path}/nope", tmp_path / "d", progress=False)
    assert e.value.code == "clone_failed" and "nope" in e.value.message and not (tmp_path / "d").exists()


def test_install_records_the_interpreters_packages_and_verify_reports_drift(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "ComfyUI"
    rep = payload(install(runner, home, "--source", up))
    state_file = home / ".h3kit" / "state.json"
    state = json.loads(state_file.read_text())
    click_pin = next(p for p in state["python_packages"] if p.lower().startswith("click=="))
    assert rep["python_packages"] == len(state["python_packages"]) > 5
    v = payload(h3(runner, "verify", "--comfy-home", home, "--json"))
    assert v["python_drift"] == {"changed": [], "added": [], "removed": []} and v["problems"] == []
    # as if click had been upgraded and a package removed since install
    state["python_packages"] = sorted([p for p in state["python_packages"] if p != click_pin] + ["click==0.1",
                                                                                               "gone-pkg==1.0"])
    state_file.write_text(json.dumps(state))
    r = h3(runner, "verify", "--comfy-home", home, "--json")
    v = payload(r)
    assert r.exit_code == 0 and v["python_drift"]["removed"] == ["gone-pkg==1.0"]
    assert v["python_drift"]["changed"] == [f"{click_pin.split('==')[0]} 0.1 -> {click_pin.split('==')[1]}"]
    assert any("changed since install" in w and "gone-pkg==1.0" in w for w in v["warnings"])
    # install records the new set
    assert ".h3kit/state.json" in payload(install(runner, home, "--source", up))["changed"]
    assert payload(h3(runner, "verify", "--comfy-home", home, "--json"))["python_drift"]["changed"] == []
