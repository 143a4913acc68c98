"""`h3kit patches rebase` and `install --commit --force` off the pin, three-way, on the fake upstream
(tests/support/fakekit.py: milliseconds, no mirror); the footprint benchmark's table on the same.

Upstream commits made here: one that changes only a context line of p1's hunk (the plain apply fails, a
three-way merge succeeds), one that changes the very line p1 changes (a real conflict).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.support.fakekit import (A_PY, NODES_PY, commit_change, git, h3, install, kit,  # noqa: F401
                                   payload, refreshed, snapshot, upstream)

ROOT = Path(__file__).resolve().parents[1]
DRIFT = A_PY.replace("line 5\n", "line five\n")    # a context line of p1's hunk: merges three-way
CLASH = A_PY.replace("line 7\n", "line VII\n")     # the line p1 changes: conflicts
HUNK = "@@ -4,7 +4,7 @@"


def rebase(runner, up, onto, out, *extra):
    return h3(runner, "patches", "rebase", "--onto", onto, "--source", up, "--out", out, "--json", *extra)


def source_state(up: Path) -> tuple:
    refs = git("for-each-ref", "--format=%(refname) %(objectname)", cwd=up)
    return refs, git("rev-parse", "HEAD", cwd=up), git("status", "--porcelain", cwd=up), snapshot(up)


def test_rebase_onto_context_drift_is_clean_and_the_refreshed_series_installs_and_verifies(refreshed, upstream,
                                                                                          runner, tmp_path):
    up, pin = upstream
    later = commit_change(up, "comfy/a.py", DRIFT)
    # the series as it is does not take the commit: p1's context moved
    r = install(runner, tmp_path / "plain", "--source", up, "--commit", later)
    assert r.exit_code == 1  # refused without --force (not the pin)
    out = tmp_path / "out"
    r = rebase(runner, up, later, out)
    assert r.exit_code == 0, r.output
    rep = payload(r)
    assert rep["onto"] == later and rep["counts"] == {"clean": 1, "merged": 1, "conflict": 0}
    # no tag, no comfyui_version.py: the pin's version, marked with the commit (git describe gave only its id)
    pin_version = json.loads((refreshed / "source_deps_info.json").read_text())["upstream"]["version"]
    assert rep["upstream"]["describe"] == f"{pin_version}+{later[:8]}"
    assert (out / "report.json").read_text().startswith('{\n  "ok": true,\n')  # read by people too
    p1 = rep["patches"][0]
    assert p1["patch"] == "p1-change-a.patch" and p1["state"] == "merged"
    a = next(f for f in p1["files"] if f["file"] == "comfy/a.py")
    assert a["hunks"] == [{"hunk": HUNK, "state": "merged", "conflict": []}]
    assert rep["patches"][1]["state"] == "clean"
    text = (out / "patches" / "p1-change-a.patch").read_text()
    assert " line five\n" in text and " line 5\n" not in text  # the new context
    assert f"index {git('rev-parse', f'{later}:comfy/a.py', cwd=up)}.." in text  # the new base
    assert f"Upstream-Commit: {later}\n" in text and "Description: Change a.py and add new.py\n long text\n" in text
    assert (out / "source_deps_info.json").read_text().startswith('{\n  "')  # as the checkout's: diffs stay small
    data = json.loads((out / "source_deps_info.json").read_text())
    assert data["upstream"]["commit"] == later
    assert (out / "patches" / "src" / "comfy" / "new.py").read_text() == (refreshed / "patches" / "src" / "comfy" /
                                                                          "new.py").read_text()  # the series whole
    assert (out / "report.txt").read_text().startswith("h3kit patches rebase: the series from")
    # the checkout's series is untouched until asked; --write puts the refreshed one in place
    assert "line five" not in (refreshed / "patches" / "p1-change-a.patch").read_text()
    r = rebase(runner, up, later, tmp_path / "out2", "--write")
    assert r.exit_code == 0, r.output
    assert (refreshed / "patches" / "p1-change-a.patch").read_text() == text
    assert h3(runner, "patches", "check", "--source", up).exit_code == 0
    # a header naming another upstream commit than the pin is a problem check names
    data = json.loads((refreshed / "source_deps_info.json").read_text())
    (refreshed / "source_deps_info.json").write_text(json.dumps({**data, "upstream": {**data["upstream"], "commit": pin}}))
    r = h3(runner, "patches", "check")
    assert r.exit_code == 1 and f"Upstream-Commit: {later[:12]}, the pin is {pin[:12]}" in r.output
    (refreshed / "source_deps_info.json").write_text(json.dumps(data))
    home = tmp_path / "home"
    r = install(runner, home, "--source", up)
    assert r.exit_code == 0, r.output
    assert payload(r)["pin"] == later and [p["state"] for p in payload(r)["patches"]] == ["apply", "apply"]
    assert (home / "comfy" / "a.py").read_text() == DRIFT.replace("line 7\n", "line seven\n")
    r = h3(runner, "verify", "--comfy-home", home, "--json")
    assert r.exit_code == 0, r.output


def test_rebase_onto_a_real_conflict_names_the_hunk_and_changes_nothing_else(refreshed, upstream, runner, tmp_path):
    up, pin = upstream
    clash = commit_change(up, "comfy/a.py", CLASH)
    kit_before = snapshot(refreshed)
    src_before = source_state(up)
    out = tmp_path / "out"
    r = rebase(runner, up, clash, out)
    assert r.exit_code == 1, r.output
    rep = payload(r)
    assert rep["counts"] == {"clean": 1, "merged": 0, "conflict": 1}
    (c,) = rep["conflicts"]
    assert (c["patch"], c["file"], c["hunk"]) == ("p1-change-a.patch", "comfy/a.py", HUNK)
    assert "line VII" in "\n".join(c["conflict"]) and "line seven" in "\n".join(c["conflict"])
    marked = (out / "conflicts" / "p1-change-a.patch" / "comfy" / "a.py").read_text()
    assert "<<<<<<< upstream" in marked and ">>>>>>> p1-change-a.patch" in marked
    assert not (out / "patches").exists() and (out / "report.json").is_file()
    assert snapshot(refreshed) == kit_before  # the checkout's series and manifest
    assert source_state(up) == src_before  # the source tree and its refs
    report = (out / "report.txt").read_text().splitlines()
    assert report[1:] == ["1 clean, 0 merged three-way, 1 conflicting", "",
                          "conflict p1-change-a.patch", "         conflict comfy/a.py", f"           conflict {HUNK}",
                          *[f"             | {ln}" for ln in c["conflict"]], "clean    p2-change-nodes.patch", "",
                          report[-1]] and report[-1].startswith("The files with conflict markers are under conflicts/")
    # the same without --json: the hunk is named for people too
    r = h3(runner, "patches", "rebase", "--onto", clash, "--source", up, "--out", tmp_path / "out3")
    assert r.exit_code == 1 and f"conflict {HUNK}" in " ".join(r.output.split())
    # bad input: exit 2, no traceback
    r = rebase(runner, up, "no-such-branch", tmp_path / "out4")
    assert r.exit_code == 2 and payload(r)["error"]["code"] == "no_such_revision"
    r = rebase(runner, up, clash, out)  # --out holds the last report
    assert r.exit_code == 2 and "--out" in payload(r)["error"]["message"]
    # the maintainer resolves the marked file and replays with it: a refreshed series that takes the commit
    r = rebase(runner, up, clash, tmp_path / "out5", "--resolved", out / "conflicts")
    assert r.exit_code == 2 and payload(r)["error"]["code"] == "unresolved"  # markers still there
    (out / "conflicts" / "p1-change-a.patch" / "comfy" / "a.py").write_text(CLASH.replace("line VII\n", "line VII-seven\n"))
    r = rebase(runner, up, clash, tmp_path / "out6", "--resolved", out / "conflicts")
    assert r.exit_code == 0, r.output
    rep = payload(r)
    assert rep["counts"] == {"clean": 1, "merged": 1, "conflict": 0}
    assert rep["patches"][0]["files"][0]["state"] == "resolved"
    text = (tmp_path / "out6" / "patches" / "p1-change-a.patch").read_text()
    assert "-line VII\n+line VII-seven\n" in text
    assert snapshot(refreshed) == kit_before and source_state(up) == src_before


def test_install_off_the_pin_merges_three_way_records_it_and_verify_checks_it(refreshed, upstream, runner, tmp_path):
    up, pin = upstream
    home = tmp_path / "home"
    assert install(runner, home, "--source", up).exit_code == 0
    later = commit_change(up, "comfy/a.py", DRIFT)
    r = install(runner, home, "--source", up, "--commit", later, "--force")
    assert r.exit_code == 0, r.output
    rep = payload(r)
    assert rep["merge"] == {"onto": later, "base": pin, "patches": [{"patch": "p1-change-a.patch", "how": "3-way"},
                                                                   {"patch": "p2-change-nodes.patch", "how": "plain"}]}
    assert [p["how"] for p in rep["patches"]] == ["3-way", "plain"]
    assert (home / "comfy" / "a.py").read_text() == DRIFT.replace("line 7\n", "line seven\n")
    state = json.loads((home / ".h3kit" / "state.json").read_text())
    assert state["pin"] == later and state["pin_verified"] is False and state["merge"] == rep["merge"]
    r = h3(runner, "verify", "--comfy-home", home, "--json")
    assert r.exit_code == 0, r.output
    assert any("merged three-way onto" in w for w in payload(r)["warnings"])
    # a re-run changes nothing; an edit of the merged file is a problem verify names
    r = install(runner, home, "--source", up, "--commit", later, "--force")
    assert r.exit_code == 0 and payload(r)["changed"] == [], r.output
    (home / "comfy" / "a.py").write_text(DRIFT)
    r = h3(runner, "verify", "--comfy-home", home, "--json")
    assert r.exit_code == 1 and "comfy/a.py differs from what the series produces" in " ".join(payload(r)["problems"])
    assert install(runner, home, "--source", up, "--commit", later, "--force").exit_code == 0
    # a commit that conflicts even three-way: refused naming patch, file and hunk; the tree as it was
    clash = commit_change(up, "comfy/a.py", CLASH)
    before = snapshot(home)
    head = git("rev-parse", "HEAD", cwd=home)
    r = install(runner, home, "--source", up, "--commit", clash, "--force")
    assert r.exit_code == 1
    err = payload(r)["error"]
    assert err["code"] == "patch_conflict"
    assert f"p1-change-a.patch: comfy/a.py hunk {HUNK}" in err["message"]
    assert err["details"]["conflicts"][0]["hunk"] == HUNK
    assert git("rev-parse", "HEAD", cwd=home) == head and snapshot(home) == before
    # revert takes the merged series back off (its copy is what install applied)
    r = h3(runner, "revert", "--comfy-home", home, "--json")
    assert r.exit_code == 0, r.output
    assert (home / "comfy" / "a.py").read_text() == DRIFT
    # and from the merged series straight back onto the pin
    assert install(runner, home, "--source", up, "--commit", later, "--force").exit_code == 0
    r = install(runner, home, "--source", up, "--force")
    assert r.exit_code == 0 and payload(r)["merge"] is None, r.output
    assert "merge" not in json.loads((home / ".h3kit" / "state.json").read_text())
    assert h3(runner, "verify", "--comfy-home", home).exit_code == 0


def test_install_commit_takes_a_tag_a_branch_or_a_prefix_resolved_once_and_recorded(refreshed, upstream, runner,
                                                                                      tmp_path):
    up, pin = upstream
    later = commit_change(up, "comfy/a.py", DRIFT)
    git("tag", "-a", "-m", "release", "v9.9.9", later, cwd=up)  # annotated: the tag object is not the commit
    git("branch", "newer", later, cwd=up)
    home = tmp_path / "home"
    for word in ("v9.9.9", "newer", later[:9]):
        r = install(runner, home, "--source", up, "--commit", word, "--force")
        assert r.exit_code == 0, (word, r.output)
        assert payload(r)["pin"] == later and payload(r)["requested"] == word
        state = json.loads((home / ".h3kit" / "state.json").read_text())
        assert (state["pin"], state["commit_requested"], state["pin_verified"]) == (later, word, False)
        assert git("rev-parse", "HEAD", cwd=home) == later
        r = h3(runner, "verify", "--comfy-home", home, "--json")
        assert r.exit_code == 0 and payload(r)["requested"] == word and payload(r)["pin"] == later, r.output
        assert f"installed at commit {word} = {later[:12]}" in " ".join(payload(r)["warnings"])
        r = h3(runner, "patches", "status", "--comfy-home", home, "--json")
        assert payload(r)["installed"] == {"commit": later, "requested": word}
    r = h3(runner, "verify", "--comfy-home", home)
    assert f"is at commit {later[:9]} = {later[:12]}" in r.output
    # the branch the source's HEAD is on is a word like any other; without --force it is refused naming both
    r = install(runner, tmp_path / "other", "--source", up, "--commit", "newer")
    assert r.exit_code == 1 and payload(r)["error"]["code"] == "not_the_pin"
    assert f"--commit newer ({later[:12]}) is not the pin" in payload(r)["error"]["message"]
    # a word the source does not hold, and one git would read as an option: exit 2 before anything is written
    for word, code in (("no-such-branch", "no_such_revision"), ("-upload-pack=x", "bad_revision"),
                       ("a..b", "bad_revision")):
        r = install(runner, tmp_path / "never", "--source", up, "--commit", word, "--force")
        assert r.exit_code == 2 and payload(r)["error"]["code"] == code, (word, r.output)
        assert not (tmp_path / "never").exists()
    # patches rebase resolves --onto the same way: the tag reaches the same commit
    r = rebase(runner, up, "v9.9.9", tmp_path / "out")
    assert r.exit_code == 0 and payload(r)["onto"] == later, r.output
    # the tag names the new upstream in the manifest: its version without the "v", git describe's words
    assert (payload(r)["upstream"]["version"], payload(r)["upstream"]["describe"]) == ("9.9.9", "v9.9.9")


def test_the_footprint_benchmark_counts_plain_three_way_and_conflict(refreshed, upstream, tmp_path):
    up, pin = upstream
    commit_change(up, "nodes.py", (up / "nodes.py").read_text() + "\n\ndef later():\n    pass\n")  # plain
    commit_change(up, "comfy/a.py", DRIFT)  # three-way
    commit_change(up, "comfy/a.py", CLASH)  # conflict
    git("branch", "side", pin, cwd=up)
    git("checkout", "-q", "side", cwd=up)
    commit_change(up, "comfy/a.py", DRIFT.replace("line 19\n", "line nineteen\n"))  # three-way
    bench = ROOT / "benchmarks" / "patch_footprint.py"
    proc = subprocess.run([sys.executable, str(bench), "--source", str(up), "--root", str(refreshed),
                           "--branch", "master", "--branch", "side"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {ln.split()[0]: ln.split()[1:] for ln in proc.stdout.splitlines() if ln.startswith(("master", "side"))}
    assert rows == {"master": ["3", "1", "1", "1"], "side": ["1", "0", "1", "0"]}, proc.stdout
    proc = subprocess.run([sys.executable, str(bench), "--source", str(up), "--root", str(refreshed), "--json",
                           "--branch", "master"], capture_output=True, text=True, timeout=300)
    (row,) = json.loads(proc.stdout)["rows"]
    assert [d["verdict"] for d in row["detail"]] == ["plain", "three-way", "conflict"]
    assert row["detail"][2]["conflicts"] == [f"p1-change-a.patch: comfy/a.py {HUNK}"]


# ---- written for tools/mutate.py --module rebase's survivors (docs/testing.md, issue 40) ---------------------

def test_the_upstream_commit_field_is_replaced_with_its_folded_lines_and_added_last():
    from h3kit.rebase import header_with_commit
    header = "Description: x\n long\nUpstream-Commit: 0ld\n folded\n\tand tabbed\nOrigin: vendor, h3kit\n"
    assert header_with_commit(header, "c0ffee") == ("Description: x\n long\nOrigin: vendor, h3kit\n"
                                                    "Upstream-Commit: c0ffee\n")


def test_a_resolved_conflict_marks_its_hunk_resolved_and_leaves_the_others_as_they_were(refreshed, upstream, runner,
                                                                                        tmp_path):
    up, _ = upstream
    clash = commit_change(up, "comfy/a.py", CLASH)
    out = tmp_path / "out"
    assert rebase(runner, up, clash, out).exit_code == 1
    (out / "conflicts" / "p1-change-a.patch" / "comfy" / "a.py").write_text(CLASH.replace("line VII\n", "line 7b\n"))
    r = rebase(runner, up, clash, tmp_path / "out2", "--resolved", out / "conflicts")
    assert r.exit_code == 0, r.output
    (p1, p2) = payload(r)["patches"]
    assert [(f["file"], f["state"]) for f in p1["files"]] == [("comfy/a.py", "resolved"), ("comfy/new.py", "clean")]
    assert [(h["hunk"], h["state"]) for h in p1["files"][0]["hunks"]] == [(HUNK, "resolved")]
    assert p2["files"][0]["hunks"][0]["state"] == "clean"


def upstream_commit(up, message: str, *change) -> str:
    """Upstream's next commit: the git command `change` run in it, committed; its full commit id."""
    git(*change, cwd=up)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message, cwd=up)
    return git("rev-parse", "HEAD", cwd=up)


def test_a_file_upstream_removed_is_a_conflict_named_for_the_file(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    gone = upstream_commit(up, "gone", "rm", "-q", "comfy/a.py")
    r = rebase(runner, up, gone, tmp_path / "out")
    assert r.exit_code == 1, r.output
    rep = payload(r)
    assert rep["counts"] == {"clean": 1, "merged": 0, "conflict": 1}
    p1 = rep["patches"][0]
    assert p1["state"] == "conflict"
    # only the file that is gone; the file the patch adds (comfy/new.py) is no conflict
    assert [(f["file"], f["state"], f["message"]) for f in p1["files"]] == [
        ("comfy/a.py", "conflict", "upstream has no comfy/a.py, which this patch changes")]
    assert [(c["file"], c["hunk"]) for c in rep["conflicts"]] == [("comfy/a.py", None)]


def test_a_file_upstream_now_has_that_the_series_adds_is_a_conflict_named_for_the_file(refreshed, upstream, runner,
                                                                                          tmp_path):
    up, pin = upstream
    (up / "comfy" / "new.py").write_text("def hello():\n    return 'upstream'\n")
    both = upstream_commit(up, "new.py upstream", "add", "comfy/new.py")
    r = rebase(runner, up, both, tmp_path / "out")
    assert r.exit_code == 1, r.output
    rep = payload(r)
    assert rep["counts"] == {"clean": 1, "merged": 0, "conflict": 1}  # p2 applied after it, on upstream's new.py
    assert [(f["file"], f["state"], f["message"]) for f in rep["patches"][0]["files"]] == [
        ("comfy/a.py", "clean", ""),
        ("comfy/new.py", "conflict", "upstream already has comfy/new.py, which this patch adds")]
    assert rep["written"] == ["conflicts/p1-change-a.patch/comfy/new.py", "report.json", "report.txt"]
    marked = (tmp_path / "out" / "conflicts" / "p1-change-a.patch" / "comfy" / "new.py").read_text()
    assert marked == (f"def hello():\n<<<<<<< upstream {both[:12]}\n    return 'upstream'\n=======\n"
                      "    return 'new'\n>>>>>>> p1-change-a.patch\n")  # git's add/add merge: the common line once
    assert "         conflict comfy/new.py: upstream already has comfy/new.py, which this patch adds" in (
        tmp_path / "out" / "report.txt").read_text().splitlines()
    # the patches after it see upstream's file, not the markers
    from h3kit import gitutil
    from h3kit.patches import Series
    from h3kit.rebase import replay
    series = Series.load(refreshed)
    rev_files = gitutil.read_blobs(up, both, series.touched_files())
    after = replay(series, gitutil.read_blobs(up, pin, series.touched_files()), rev_files, both).after
    assert after["comfy/new.py"] == rev_files["comfy/new.py"] == b"def hello():\n    return 'upstream'\n"


def test_a_deletion_of_a_file_upstream_changed_is_a_conflict_with_gits_reason(kit, upstream, runner, tmp_path):
    """A deletion cannot merge three-way: git's own words name the file."""
    from h3kit import gitutil
    from h3kit.patches import Series
    from h3kit.rebase import replay
    up, pin = upstream
    clone = tmp_path / "clone"
    git("clone", "-q", str(up), str(clone), cwd=tmp_path)
    git("rm", "-q", "comfy/cli_args.py", cwd=clone)
    deletion = git("diff", "--cached", "--full-index", cwd=clone) + "\n"
    header = "Description: Drop cli_args.py\nOrigin: vendor, h3kit\nForwarded: not-needed\nLast-Update: 2026-12-06\n"
    (kit / "patches" / "p3-drop-cli-args.patch").write_text(header + "---\n" + deletion)
    with (kit / "patches" / "series").open("a") as f:
        f.write("p3-drop-cli-args.patch\n")
    series = Series.load(kit)
    pin_files = gitutil.read_blobs(up, pin, series.touched_files())
    assert replay(series, pin_files, pin_files, "e" * 40).after["comfy/cli_args.py"] is None  # deleted on the pin
    changed = pin_files["comfy/cli_args.py"] + b"# upstream's new line\n"
    rep = replay(series, pin_files, {**pin_files, "comfy/cli_args.py": changed}, "f" * 40)
    assert [p.state for p in rep.patches] == ["clean", "clean", "conflict"]
    [f] = rep.patches[2].files
    assert f.state == "conflict" and f.message.startswith("git apply --3way: error: ") and "cli_args.py" in f.message


def test_out_may_be_an_empty_folder_and_never_a_file(refreshed, upstream, runner, tmp_path):
    up, _ = upstream
    later = commit_change(up, "comfy/a.py", DRIFT)
    (tmp_path / "empty").mkdir()
    r = rebase(runner, up, later, tmp_path / "empty")
    assert r.exit_code == 0, r.output
    (tmp_path / "afile").write_text("mine\n")
    r = rebase(runner, up, later, tmp_path / "afile")
    assert r.exit_code == 2 and "--out" in payload(r)["error"]["message"]
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_a_conflicting_patch_keeps_the_hunks_that_merge_for_the_patches_after_it(kit, upstream, runner):
    """Two hunks in p1: one meets context drift (merges three-way), one meets a change of its own line (conflicts):
    the queue holds the first applied and upstream's text at the second."""
    from h3kit import gitutil
    from h3kit.patches import Series
    from h3kit.rebase import replay
    up, pin = upstream
    second = ("@@ -14,7 +14,7 @@\n line 14\n line 15\n line 16\n-line 17\n+line seventeen\n line 18\n line 19\n"
              " line 20\n")
    (kit / "patches" / "p1-change-a.patch").write_text((kit / "patches" / "p1-change-a.patch").read_text() + second)
    r = h3(runner, "patches", "refresh", "--source", up, "--add", "p1-change-a.patch:comfy/new.py")
    assert r.exit_code == 0, r.output
    series = Series.load(kit)
    touched = series.touched_files()
    pin_files = gitutil.read_blobs(up, pin, touched)

    def onto(a_py):
        rep = replay(series, pin_files, {**pin_files, "comfy/a.py": a_py.encode()}, "f" * 40)
        [a] = [f for f in rep.patches[0].files if f.path == "comfy/a.py"]
        assert rep.after["nodes.py"].decode().startswith("import os\n\nNODES = ['a', 'b', 'multinpu']\n")  # p2 tried
        return rep.patches[0].state, [h.state for h in a.hunks], rep.after["comfy/a.py"].decode()
    clash = A_PY.replace("line 17\n", "line XVII\n")
    drift_and_clash = DRIFT.replace("line 17\n", "line XVII\n")
    assert onto(drift_and_clash) == ("conflict", ["merged", "conflict"],
                                     drift_and_clash.replace("line 7\n", "line seven\n"))
    assert onto(clash) == ("conflict", ["clean", "conflict"], clash.replace("line 7\n", "line seven\n"))


def test_a_refreshed_patch_of_an_executable_file_keeps_its_mode(refreshed, upstream, runner, tmp_path):
    """...and only the index line: a line of the file that ends like a mode is the file's."""
    up, _ = upstream
    (up / "nodes.py").write_text(NODES_PY.replace("import os\n", "import os  # umask 100644\n"))
    git("add", "nodes.py", cwd=up)
    later = upstream_commit(up, "executable", "update-index", "--chmod=+x", "nodes.py")
    r = rebase(runner, up, later, tmp_path / "out")
    assert r.exit_code == 0, r.output
    text = (tmp_path / "out" / "patches" / "p2-change-nodes.patch").read_text()
    blob = git("rev-parse", f"{later}:nodes.py", cwd=up)
    assert f"\nindex {blob}.." in text and text.split(f"\nindex {blob}..")[1].split("\n")[0].endswith(" 100755")
    assert "\n import os  # umask 100644\n" in text


def test_a_source_lacking_a_file_the_series_changes_is_refused_naming_it(refreshed, upstream, runner, tmp_path,
                                                                          monkeypatch):
    """A mirror without some blobs (upstream's LFS files) checks out without them: a missing file the series changes
    refuses the rebase; one it does not change is only named, as the progress goes on."""
    from h3kit import gitutil
    up, _ = upstream
    later = commit_change(up, "comfy/a.py", DRIFT)
    checkout = gitutil.checkout_detached
    lacks = []

    def lacking(tree, commit, **kw):
        checkout(tree, commit, **kw)
        return list(lacks)
    monkeypatch.setattr(gitutil, "checkout_detached", lacking)
    lacks[:] = ["comfy/a.py", "nodes.py", "models/big.bin"]
    r = rebase(runner, up, later, tmp_path / "out")
    err = payload(r)["error"]
    assert r.exit_code == 1 and err["code"] == "incomplete_source", r.output
    assert err["message"] == "the source lacks files the series changes: comfy/a.py, nodes.py"
    lacks[:] = ["models/big.bin"]
    r = h3(runner, "patches", "rebase", "--onto", later, "--source", up, "--out", tmp_path / "out2")
    assert r.exit_code == 0, r.output
    progress = [ln for ln in r.stderr.splitlines() if ln.startswith("h3kit: ")]
    assert progress[1:] == [f"h3kit: checking out {later[:12]} ...", "h3kit: warning: the source lacks models/big.bin",
                            f"h3kit: applying 2 patches three-way onto {later[:12]} ...",
                            "h3kit:   p1-change-a.patch: merged", "h3kit:   p2-change-nodes.patch: clean"], r.stderr


def test_merge_file_counts_up_to_127_conflicts_and_its_fatal_exit_is_an_error(tmp_path, monkeypatch):
    """git merge-file exits with the number of conflicts, at most 127; git's fatal errors exit 128, a signal is a
    negative code: those are no merge result."""
    import pytest

    from h3kit import rebase as lib
    labels = ("upstream 0123456789ab", "base", "p1.patch")
    ours, base, theirs = b"a\nB\nc\n", b"a\nb\nc\n", b"a\nb2\nc\n"
    clean, text = lib._merge(tmp_path, ours, base, ours, labels)
    assert (clean, text) == (True, ours)
    clean, text = lib._merge(tmp_path, ours, base, theirs, labels)
    assert not clean and text == b"a\n<<<<<<< upstream 0123456789ab\nB\n=======\nb2\n>>>>>>> p1.patch\nc\n"
    for code in (127, 128, -9):
        monkeypatch.setattr(lib, "_git", lambda *a, code=code, **kw: subprocess.CompletedProcess(
            a, code, b"merged text", b"fatal: out of memory"))
        if code == 127:
            assert lib._merge(tmp_path, ours, base, theirs, labels) == (False, b"merged text")
            continue
        with pytest.raises(lib.RebaseError, match="git merge-file failed: fatal: out of memory"):
            lib._merge(tmp_path, ours, base, theirs, labels)


def test_a_hunk_is_tried_alone_on_the_content_given_and_nothing_left_from_the_try_before(tmp_path):
    from h3kit import rebase as lib
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    patch = ("diff --git a/comfy/a.py b/comfy/a.py\n--- a/comfy/a.py\n+++ b/comfy/a.py\n"
             "@@ -6,3 +6,3 @@\n line 6\n-line 7\n+line seven\n line 8\n")
    assert lib._apply_alone(scratch, "comfy/a.py", CLASH.encode(), patch) is None
    assert lib._apply_alone(scratch, "comfy/a.py", A_PY.encode(), patch) == A_PY.replace("line 7\n",
                                                                                        "line seven\n").encode()
    other = patch.split("@@")[0] + "@@ -12,3 +12,3 @@\n line 12\n-line 13\n+line 13b\n line 14\n"
    assert lib._apply_alone(scratch, "comfy/a.py", A_PY.encode(), other) == A_PY.replace("line 13\n",
                                                                                        "line 13b\n").encode()
    assert lib._apply_alone(scratch, "comfy/a.py", None, patch) is None  # no such file: the last try's is gone


def test_git_works_in_the_scratch_folder_whatever_repository_encloses_it_or_the_environment_names(tmp_path,
                                                                                                  monkeypatch):
    """A scratch folder inside another work tree (a comfy-home, a TMPDIR in a checkout) or an environment that names
    another repository (h3kit run from a git hook: GIT_DIR, GIT_WORK_TREE, GIT_INDEX_FILE) changes nothing. Without
    the ceiling, `git apply` in a subfolder of a work tree takes its paths from the work tree's top, skips them as
    outside the folder and exits 0: the hunk would be called clean and not applied."""
    from h3kit import rebase as lib
    outer = tmp_path / "outer"
    (outer / "scratch").mkdir(parents=True)
    git("init", "-q", cwd=outer)
    patch = ("diff --git a/comfy/a.py b/comfy/a.py\n--- a/comfy/a.py\n+++ b/comfy/a.py\n"
             "@@ -6,3 +6,3 @@\n line 6\n-line 7\n+line seven\n line 8\n")
    patched = A_PY.replace("line 7\n", "line seven\n").encode()
    assert lib._apply_alone(outer / "scratch", "comfy/a.py", A_PY.encode(), patch) == patched
    other = tmp_path / "other"
    (other / "comfy").mkdir(parents=True)
    git("init", "-q", cwd=other)
    for name, value in (("GIT_DIR", other / ".git"), ("GIT_WORK_TREE", other),
                        ("GIT_INDEX_FILE", other / ".git" / "index")):
        monkeypatch.setenv(name, str(value))
    assert lib._apply_alone(outer / "scratch", "comfy/a.py", A_PY.encode(), patch) == patched
    queue = tmp_path / "queue"
    queue.mkdir()
    head = lib._queue_repo(queue, ["comfy/a.py"], {"comfy/a.py": A_PY.encode()}, "0" * 40, [])
    assert git("--git-dir", str(queue / ".git"), "show", f"{head}:comfy/a.py", cwd=queue) == A_PY.rstrip("\n")
    assert not (other / ".git" / "index").exists() and not list((other / ".git" / "refs" / "heads").iterdir())


def test_a_conflicting_hunk_with_no_message_of_its_file_says_upstream_changed_its_lines():
    """The conflicts list (`--json` and the printed report): a hunk git marked carries the generic reason, a file
    that could not be tried (no hunk) carries its own message."""
    from h3kit import rebase as lib
    region = ["<<<<<<< upstream 0123456789ab", "line VII", "=======", "line seven", ">>>>>>> p1-change-a.patch"]
    a = lib.FileResult("comfy/a.py", "conflict", [lib.HunkResult("@@ -6,3 +6,3 @@", "conflict", region),
                                                  lib.HunkResult("@@ -12,3 +12,3 @@", "merged")])
    b = lib.FileResult("comfy/b.py", "conflict", message="upstream removed comfy/b.py")
    replay = lib.Replay("0123456789ab" + "0" * 28, [lib.PatchResult("p1-change-a.patch", "conflict", [a, b]),
                                                     lib.PatchResult("p2-change-nodes.patch", "clean")], {}, {})
    assert replay.conflicting_hunks() == [
        {"patch": "p1-change-a.patch", "file": "comfy/a.py", "hunk": "@@ -6,3 +6,3 @@",
         "message": "upstream changed the lines this hunk changes", "conflict": region},
        {"patch": "p1-change-a.patch", "file": "comfy/b.py", "hunk": None, "message": "upstream removed comfy/b.py",
         "conflict": []}]


def test_a_series_without_index_lines_merges_all_the_same(kit, upstream):
    """An older h3kit's series (hand-written sections, no `index` line, so no mode) is replayed with the index lines
    the pin's walk gives, the file's mode the default: p1 merges over the context drift, p2 applies as it is."""
    from h3kit import gitutil
    from h3kit.patches import Series
    from h3kit.rebase import replay
    up, pin = upstream
    series = Series.load(kit)
    assert [s.mode for p in series.patches for s in p.sections] == [None, None]
    pin_files = gitutil.read_blobs(up, pin, series.touched_files())
    rep = replay(series, pin_files, {**pin_files, "comfy/a.py": DRIFT.encode()}, "f" * 40)
    assert [p.state for p in rep.patches] == ["merged", "clean"]
    assert rep.after["comfy/a.py"].decode() == DRIFT.replace("line 7\n", "line seven\n")
    assert "\nindex " in rep.texts["p1-change-a.patch"] and " line five\n" in rep.texts["p1-change-a.patch"]


def test_a_file_is_a_conflict_where_git_leaves_it_unmerged_or_any_hunk_conflicts_alone(tmp_path, monkeypatch):
    """git's whole-file merge and the hunks tried one by one each have a veto: a file git leaves unmerged is a
    conflict though each hunk merged alone, and a hunk that conflicts alone is never dropped from a file git merged.
    A resolution that still holds a separator line is refused like one that holds a whole marked region."""
    import pytest

    from h3kit import rebase as lib
    from h3kit.errors import UsageError
    repo = tmp_path / "queue"
    repo.mkdir()
    lib._git(repo, "init", "-q")
    (repo / "a.py").write_bytes(b"<<<<<<< ours\nx\n=======\ny\n>>>>>>> theirs\n")
    step = SimpleNamespace(patch=SimpleNamespace(name="p1.patch"), before={"a.py": b"base\n"})
    section = SimpleNamespace(path="a.py")

    def judged(states, unmerged, resolved=None):
        hunks = [lib.HunkResult(f"@@ -{i},3 +{i},3 @@", state) for i, state in enumerate(states)]
        monkeypatch.setattr(lib, "classify", lambda *a: (hunks, b"partial\n"))
        return lib._merged_file(repo, tmp_path, step, section, {"a.py": b"ours\n"}, unmerged, "upstream 0123",
                                resolved or {}).state
    assert judged(["merged", "merged"], {"a.py"}) == "conflict"
    assert judged(["merged", "conflict"], set()) == "conflict"
    assert judged(["clean", "merged"], set()) == "merged"
    assert judged(["clean", "clean"], set()) == "clean"
    assert judged(["merged", "conflict"], {"a.py"}, {"p1.patch": {"a.py": b"x\ny\n"}}) == "resolved"
    for leftover in (b"x\n=======\ny\n", b"<<<<<<< upstream 0123\nx\n=======\ny\n>>>>>>> p1.patch\n"):
        with pytest.raises(UsageError, match="still holds conflict markers"):
            judged(["merged", "conflict"], {"a.py"}, {"p1.patch": {"a.py": leftover}})
