"""Build hook (the metadata is in setup.cfg): an installed h3kit carries its data as package data.

patches/, additional_files/, workflows/, launch/ and source_deps_info.json live at the top of the checkout,
where maintainers edit them; a build copies them into h3kit/_data/ of the wheel, where h3kit.paths reads them
through importlib.resources. docs/, README.md and LICENSE go there too (`h3kit --help` names the folder). An editable install (`pip install -e .`) copies nothing: it reads the checkout.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DATA_ENTRIES = ("patches", "additional_files", "workflows", "launch", "source_deps_info.json")  # h3kit.paths
# what a wheel user reads: the docs that --help and error fixes cite, and the licence (also in .dist-info)
DOC_ENTRIES = ("docs", "README.md", "LICENSE")


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest = Path(self.build_lib) / "h3kit" / "_data"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for name in DATA_ENTRIES + DOC_ENTRIES:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, dest / name)


setup(cmdclass={"build_py": BuildPyWithData})
