"""h3kit.patchfile's parsing and rendering on small hand-written patches (the engine around it, with real trees,
is test_patch_engine.py). Written for the survivors of tools/mutate.py --module patchfile."""

from __future__ import annotations

import pytest

from h3kit import patchfile

HEADER = "Description: a test\nOrigin: h3kit\nForwarded: not-needed\nLast-Update: 2026-12-02\n---\n"


def parsed(tmp_path, body: str) -> patchfile.PatchFile:
    p = tmp_path / "t.patch"
    p.write_text(HEADER + body)
    return patchfile.parse_patch(p)


def test_hunk_headers_with_and_without_lengths(tmp_path):
    pf = parsed(tmp_path, "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n"
                          "@@ -7 +9,2 @@\n-old\n+new\n+more\n"
                          "@@ -20,2 +23 @@\n-a\n-b\n+c\n")
    (sec,) = pf.sections
    assert [(h.old_start, h.old_len, h.new_start, h.new_len) for h in sec.hunks] == [(7, 1, 9, 2), (20, 2, 23, 1)]
    assert not sec.new_file and not sec.deleted_file
    # the failing hunk git names: by old start, or by new start in reverse; two hunks and no match: none
    assert pf.find_hunk("x.py", 20) is sec.hunks[1] and pf.find_hunk("x.py", 9, reverse=True) is sec.hunks[0]
    assert pf.find_hunk("x.py", 5) is None and pf.find_hunk("y.py", 7) is None


def test_a_single_hunk_is_the_failing_one_whatever_line_git_names(tmp_path):
    pf = parsed(tmp_path, "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -3,1 +3,1 @@\n-a\n+b\n")
    assert pf.find_hunk("x.py", 99) is pf.sections[0].hunks[0]


def test_new_and_deleted_file_sections(tmp_path):
    pf = parsed(tmp_path, "diff --git a/n.py b/n.py\nnew file mode 100644\n--- /dev/null\n+++ b/n.py\n"
                          "@@ -0,0 +1 @@\n+x\n"
                          "diff --git a/d.py b/d.py\ndeleted file mode 100644\n--- a/d.py\n+++ /dev/null\n"
                          "@@ -1 +0,0 @@\n-y\n")
    new, gone = pf.sections
    assert new.new_file and not new.deleted_file and gone.deleted_file and not gone.new_file
    assert (new.hunks[0].new_start, new.hunks[0].new_len, gone.hunks[0].old_len, gone.hunks[0].new_len) == (1, 1, 1, 0)


def test_a_hunk_whose_counts_do_not_match_its_header_is_refused(tmp_path):
    with pytest.raises(patchfile.PatchFormatError, match="has 1 old and 1 new lines"):
        parsed(tmp_path, "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1,2 +1 @@\n-a\n+b\n"
                         "diff --git a/y.py b/y.py\n--- a/y.py\n+++ b/y.py\n@@ -1 +1 @@\n-a\n+b\n")


def test_a_new_file_section_as_written():
    assert patchfile.render_new_file_section("a/b.py", b"x\n") == (
        "diff --git a/a/b.py b/a/b.py\nnew file mode 100644\n"
        "index 0000000000000000000000000000000000000000..587be6b4c3f93f93c489c0111bba5596147a26cb\n--- /dev/null\n+++ b/a/b.py\n@@ -0,0 +1 @@\n+x\n")
    assert patchfile.render_new_file_section("c.py", b"x\ny") == (
        "diff --git a/c.py b/c.py\nnew file mode 100644\n"
        "index 0000000000000000000000000000000000000000..1b322989b6eea65102d4f5921ccb7df5dc613fe7\n--- /dev/null\n+++ b/c.py\n@@ -0,0 +1,2 @@\n+x\n+y\n"
        "\\ No newline at end of file\n")
    with pytest.raises(patchfile.PatchFormatError, match="empty source file"):
        patchfile.render_new_file_section("e.py", b"")


def test_the_index_line_is_read_where_git_writes_it_and_nowhere_else(tmp_path):
    """git diff writes a section's `index` line right after its header (a modified file), after `new file mode`
    (a new file: its mode is the new file's) or after `old mode` / `new mode` (a mode change): each is read; a line further down is a
    file's content, not the index."""
    a, b, z = "1" * 40, "2" * 40, "0" * 40
    pf = parsed(tmp_path, f"diff --git a/m.py b/m.py\nindex {a}..{b} 100644\n--- a/m.py\n+++ b/m.py\n"
                          "@@ -1 +1 @@\n-a\n+b\n"
                          f"diff --git a/n.py b/n.py\nnew file mode 100755\nindex {z}..{b}\n--- /dev/null\n+++ b/n.py\n"
                          "@@ -0,0 +1 @@\n+x\n"
                          f"diff --git a/x.sh b/x.sh\nold mode 100644\nnew mode 100755\nindex {a}..{b}\n--- a/x.sh\n"
                          "+++ b/x.sh\n@@ -1 +1 @@\n-a\n+b\n"
                          f"diff --git a/p.py b/p.py\n--- a/p.py\n+++ b/p.py\n@@ -1 +1 @@\n-a\n+index {a}..{b}\n")
    assert [(s.path, s.index_old, s.index_new, s.mode) for s in pf.sections] == [
        ("m.py", a, b, "100644"), ("n.py", z, b, "100755"), ("x.sh", a, b, None), ("p.py", None, None, None)]
    with pytest.raises(patchfile.PatchFormatError, match="m.py: malformed line 'index 12..34'"):
        parsed(tmp_path, "diff --git a/m.py b/m.py\nindex 12..34\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-a\n+b\n")


def test_a_no_newline_marker_after_the_last_line_of_a_hunk_belongs_to_it(tmp_path):
    import threading
    body = ("diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n\\ No newline at end of file\n"
            "+b\n\\ No newline at end of file\n"
            "diff --git a/y.py b/y.py\n--- a/y.py\n+++ b/y.py\n@@ -1 +1 @@\n-c\n+d\n")
    got = []
    t = threading.Thread(target=lambda: got.append(parsed(tmp_path, body)), daemon=True)
    t.start()
    t.join(timeout=10)  # bounds a parser that never leaves the marker
    assert got, "parse_patch did not return"
    x, y = got[0].sections
    assert x.hunks[0].lines == ["-a", "\\ No newline at end of file", "+b", "\\ No newline at end of file"]
    assert y.path == "y.py" and y.hunks[0].lines == ["-c", "+d"]


def test_an_empty_line_in_a_hunk_and_a_hunk_cut_short_are_told_apart(tmp_path):
    with pytest.raises(patchfile.PatchFormatError, match=r"x.py: empty line inside a hunk \(line 6 of the section\)"):
        parsed(tmp_path, "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,3 @@\n a\n\n-b\n+c\n")
    with pytest.raises(patchfile.PatchFormatError, match="x.py: hunk '@@ -1,3 [+]1,3 @@' ends early"):
        parsed(tmp_path, "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,3 @@\n a\n-b\n+c\n"
                         "@@ -9 +9 @@\n-c\n+d\n")


def test_a_rename_section_is_refused(tmp_path):
    with pytest.raises(patchfile.PatchFormatError, match="unsupported section header 'diff --git a/x.py b/y.py'"):
        parsed(tmp_path, "diff --git a/x.py b/y.py\n--- a/x.py\n+++ b/y.py\n@@ -1 +1 @@\n-a\n+b\n")


def test_a_section_without_a_hunk_is_refused_unless_it_deletes_a_file(tmp_path):
    with pytest.raises(patchfile.PatchFormatError, match="x.py: section has no hunk"):
        parsed(tmp_path, "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n")
    # git deletes an empty file with no hunk at all
    (gone,) = parsed(tmp_path, "diff --git a/e.py b/e.py\ndeleted file mode 100644\nindex " + "1" * 40 + ".."
                               + "0" * 40 + "\n").sections
    assert gone.deleted_file and gone.hunks == []
