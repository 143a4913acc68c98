"""`install --models-dir`: h3kit's section of extra_model_paths.yaml, merged with the user's file.

The merge (h3kit.modelpaths) on its own, then install / verify / revert on the fake upstream. The pin reading
the file (its "Adding extra search path" start-up lines, /models listing a shared file) and check-workflow,
doctor and verify finding files there on a real tree: test_demo.py."""

from __future__ import annotations

import os
import shutil

import pytest
import yaml

from h3kit import modelpaths
from h3kit.errors import H3kitError, UsageError
from tests.support.fakekit import REAL_ROOT, git, h3, install, kit, payload, refreshed, upstream  # noqa: F401

TEMPLATE = (REAL_ROOT / "additional_files" / modelpaths.TEMPLATE).read_text()
USER = """# my own models
comfyui:
    base_path: /srv/other/
    checkpoints: models/checkpoints/
    loras: |
         models/loras/
         models/lycoris/
"""


def test_merge_keeps_the_users_file_and_adds_one_section_per_folder():
    merged = modelpaths.merge(USER.encode(), TEMPLATE, ["/nfs/h3", "/nfs/more models"]).decode()
    assert merged.startswith(USER)  # byte for byte, comments included
    data = yaml.safe_load(merged)
    assert data["comfyui"]["loras"] == "models/loras/\nmodels/lycoris/\n"
    assert data["h3kit_1"] == {"base_path": "/nfs/h3", "diffusion_models": "diffusion_models/",
                               "text_encoders": "text_encoders/", "vae": "vae/", "loras": "loras/"}
    assert data["h3kit_2"]["base_path"] == "/nfs/more models"
    # again with other folders: the block is replaced, not added twice; no folders: the user's file as it was
    again = modelpaths.merge(merged.encode(), TEMPLATE, ["/nfs/h3"]).decode()
    assert again.count(modelpaths.BEGIN) == 1 and "h3kit_2" not in again
    assert modelpaths.merge(again.encode(), TEMPLATE, []).decode() == USER
    # a file that held only h3kit's block goes away; no file and no folders stays no file
    alone = modelpaths.merge(None, TEMPLATE, ["/nfs/h3"])
    assert alone.startswith(modelpaths.BEGIN.encode()) and modelpaths.merge(alone, TEMPLATE, []) is None
    assert modelpaths.merge(None, TEMPLATE, []) is None
    # removing the block never judges the user's part: a file they broke since still loses only h3kit's lines
    broken = ("oops: [\n" + again).encode()
    assert modelpaths.merge(broken, TEMPLATE, []).decode() == "oops: [\n" + USER


@pytest.mark.parametrize("data, fragment", [
    (b"comfyui: [unclosed\n", "not valid YAML"),
    (b"- a list\n- of things\n", "not a mapping"),
    (b"h3kit_1:\n    base_path: /mine\n", "named like h3kit's own"),
    (f"a: 1\n{modelpaths.BEGIN}\nh3kit_1: {{}}\n".encode(), "marker lines are damaged"),
    (b"\xff\xfe\x00a", "not UTF-8"),
])
def test_merge_refuses_what_it_cannot_keep_intact(data, fragment):
    with pytest.raises(H3kitError) as e:
        modelpaths.merge(data, TEMPLATE, ["/nfs/h3"])
    assert fragment in e.value.message


def test_a_file_the_section_cannot_follow_is_refused_not_rewritten():
    with pytest.raises(H3kitError) as e:  # a flow-style mapping: appending a block would not parse
        modelpaths.merge(b"{a: {b: c},\n d: e}\n", TEMPLATE, ["/nfs/h3"])
    assert "block style" in e.value.hint


def test_folders_the_pin_would_rewrite_are_bad_input(tmp_path):
    (tmp_path / "f").write_text("x")
    for bad in ("/nfs/$HOME/h3", "~/h3", "/a\nb", str(tmp_path / "f")):
        with pytest.raises(UsageError):
            modelpaths.check_dirs([bad])
    assert modelpaths.check_dirs(["rel", "rel", "/abs"]) == [os.path.abspath("rel"), "/abs"]


@pytest.fixture
def kit_with_template(refreshed):
    dest = refreshed / "additional_files" / modelpaths.TEMPLATE
    shutil.copy(REAL_ROOT / "additional_files" / modelpaths.TEMPLATE, dest)
    return refreshed


def test_install_verify_revert_with_models_dirs(kit_with_template, upstream, runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "ComfyUI"
    shared = tmp_path / "shared"
    (shared / "diffusion_models").mkdir(parents=True)
    (shared / "diffusion_models" / "dit.safetensors").write_bytes(b"x")
    first = payload(install(runner, home, "--source", up))  # a plain install, then the user's own file
    assert first["models_dirs"] == [] and not (home / modelpaths.CONFIG).exists()
    (home / modelpaths.CONFIG).write_text(USER)
    r = install(runner, home, "--source", up, "--models-dir", shared, "--models-dir", tmp_path / "not-mounted")
    rep = payload(r)
    assert r.exit_code == 0 and rep["models_dirs"] == [str(shared), str(tmp_path / "not-mounted")]
    assert rep["changed"] == sorted([".h3kit/state.json", modelpaths.CONFIG])
    assert any("not-mounted does not exist" in w for w in rep["warnings"])
    text = (home / modelpaths.CONFIG).read_text()
    assert text.startswith(USER) and "h3kit_2" in text

    # verify sees the folders the way ComfyUI will search them, and the files there
    v = payload(h3(runner, "verify", "--comfy-home", home, "--json"))
    assert v["problems"] == [] and v["models"]["files"] == {"diffusion_models": ["dit.safetensors"]}
    assert str(shared / "diffusion_models") in v["models"]["search_paths"]["diffusion_models"]
    assert any("not-mounted is not reachable" in w for w in v["warnings"])

    # a re-run without --models-dir keeps them and changes nothing
    assert payload(install(runner, home, "--source", up))["changed"] == []
    # an edited section is a problem verify names, and install writes it again
    (home / modelpaths.CONFIG).write_text(text.replace(f'"{shared}"', '"/elsewhere"'))
    v = payload(h3(runner, "verify", "--comfy-home", home, "--json"))
    assert any("missing or was edited" in p for p in v["problems"])
    assert any(f"will not search {shared / 'diffusion_models'}" in p for p in v["problems"])
    assert payload(install(runner, home, "--source", up))["changed"] == [modelpaths.CONFIG]
    assert (home / modelpaths.CONFIG).read_text() == text

    # revert removes h3kit's section and leaves the user's file as it was
    r = h3(runner, "revert", "--comfy-home", home, "--json")
    assert r.exit_code == 0 and (home / modelpaths.CONFIG).read_text() == USER


def test_a_users_file_that_cannot_be_merged_stops_install_before_anything_is_written(kit_with_template, upstream,
                                                                                     runner, tmp_path):
    up, _ = upstream
    home = tmp_path / "ComfyUI"
    assert install(runner, home, "--source", up).exit_code == 0
    (home / modelpaths.CONFIG).write_text("comfyui: [unclosed\n")
    before = (home / ".h3kit" / "state.json").read_bytes()
    r = install(runner, home, "--source", up, "--models-dir", tmp_path / "shared")
    assert r.exit_code == 1 and payload(r)["error"]["code"] == "extra_model_paths"
    assert (home / modelpaths.CONFIG).read_text() == "comfyui: [unclosed\n"
    assert (home / ".h3kit" / "state.json").read_bytes() == before
    r = install(runner, home, "--source", up, "--models-dir", "/nfs/$USER")
    assert r.exit_code == 2 and payload(r)["error"]["code"] == "bad_models_dir"
