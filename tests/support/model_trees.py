"""A stand-in ComfyUI tree for the model listing and fetching tests (test support)."""

from __future__ import annotations

import pytest


@pytest.fixture
def home(tmp_path):
    """A ComfyUI tree as far as model lookup goes: main.py and models/."""
    h = tmp_path / "ComfyUI"
    (h / "models").mkdir(parents=True)
    (h / "main.py").write_text("")
    return h
