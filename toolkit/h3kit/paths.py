"""Where h3kit finds its own data (patches, manifest, shipped files) and its caches.

The data is patches/, additional_files/, workflows/, launch/ and source_deps_info.json (DATA_ENTRIES). An
installed h3kit (`pip install .`, a wheel, pipx) carries it as package data, h3kit/_data/, which setup.py
copies there when it builds, read through importlib.resources. A source checkout has no _data/: run from it
(PYTHONPATH=toolkit, or the editable install `make test` uses) the data is the checkout itself, found beside
the package. `H3KIT_ROOT` names a data root explicitly (a checkout under development, a test's fake kit) and
wins over both.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from h3kit.errors import H3kitError

MANIFEST_NAME = "source_deps_info.json"
DATA_DIR = "_data"
DATA_ENTRIES = ("patches", "additional_files", "workflows", "launch", MANIFEST_NAME)
ROOT_ENV = "H3KIT_ROOT"


def package_dir() -> Path:
    return Path(__file__).resolve().parent


def packaged_data() -> Path | None:
    """h3kit/_data of an installed h3kit, None in a source checkout (or a zipped install, not supported)."""
    data = importlib.resources.files("h3kit").joinpath(DATA_DIR)
    return data if isinstance(data, Path) and (data / MANIFEST_NAME).is_file() else None


def repo_root() -> Path:
    """The folder holding h3kit's data: $H3KIT_ROOT, else the installed package data, else the checkout."""
    env = os.environ.get(ROOT_ENV)
    root = Path(env) if env else packaged_data() or package_dir().parents[1]
    if not (root / MANIFEST_NAME).is_file():
        where = f"{ROOT_ENV}={env}" if env else f"h3kit at {package_dir()}"
        raise H3kitError(f"h3kit data not found: {root / MANIFEST_NAME} is missing ({where})",
                         code="no_h3kit_data",
                         hint="reinstall h3kit (pip install . from its checkout, or its wheel), or set "
                              f"{ROOT_ENV} to an h3kit checkout")
    return root


def require_checkout(what: str) -> Path:
    """The data root, refused when it is an installed package's data: maintainers' commands write it."""
    root = repo_root()
    if not os.environ.get(ROOT_ENV) and root == packaged_data():
        raise H3kitError(f"{what} changes h3kit's own patch series, and this h3kit is installed ({root})",
                         code="not_a_checkout", hint=f"run it from an h3kit checkout, or set {ROOT_ENV} to one")
    return root


def h3kit_import_code() -> str:
    """Python lines that make `import h3kit.<module>` work in another interpreter (the one running ComfyUI,
    which may not have h3kit installed) from this very package folder, without putting the rest of the
    folder it is installed in (site-packages, with other versions of ComfyUI's own dependencies) on that
    interpreter's path."""
    init, folder = str(package_dir() / "__init__.py"), str(package_dir())
    return ("import importlib.util as _iu, sys as _sys\n"
            f"_spec = _iu.spec_from_file_location('h3kit', {init!r}, submodule_search_locations=[{folder!r}])\n"
            "_sys.modules['h3kit'] = _iu.module_from_spec(_spec)\n"
            "_spec.loader.exec_module(_sys.modules['h3kit'])\n")


def import_root() -> Path:
    """A folder whose one importable entry is this h3kit package, for the path of another interpreter (the one
    running ComfyUI, which runs h3kit's parity and calibration workers and their ranks). A checkout's toolkit/
    is such a folder; an installed h3kit sits in site-packages beside its own versions of packages ComfyUI
    also imports, so it gets a private folder holding one link to the package instead."""
    if packaged_data() is None:
        return package_dir().parent
    import hashlib
    from h3kit import locks
    folder = locks.scratch_parent() / f"import-{hashlib.sha256(str(package_dir()).encode()).hexdigest()[:12]}"
    link = folder / "h3kit"
    if not (link.is_symlink() and link.resolve() == package_dir()):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".h3kit-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(package_dir(), target_is_directory=True)
        os.replace(tmp, link)
    return folder
