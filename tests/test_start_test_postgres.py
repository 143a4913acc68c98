"""tools/start-test-postgres.sh, which .ci/run calls as `URL=$(tools/start-test-postgres.sh)`: its stdout is the URL
alone, and it returns while the server it started runs on.

CI failed on 2026-12-06 because pg_ctlcluster printed "Removed stale pid file." on stdout (a machine that had not
shut its cluster down cleanly) and the URL the tests read began with it. Here Debian's tools are stand-ins on PATH:
pg_ctlcluster says just that and leaves a daemon behind holding every descriptor it was given, as a server would.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from tests.support import requires

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "start-test-postgres.sh"


def _tool(bin_dir: Path, name: str, body: str):
    p = bin_dir / name
    p.write_text("#!/usr/bin/env bash\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


def _standins(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "online"
    _tool(bin_dir, "pg_lsclusters", f'[ -e {state} ] && s=online || s=down; echo "15 main 5433 $s postgres /d /l"')
    # as pg_ctl's server: standard descriptors to its log, every other one it was given (a pipe to the caller's
    # $(...) among them) kept, for 30 s
    _tool(bin_dir, "pg_ctlcluster", f'echo "Removed stale pid file."; touch {state}; '
          '(sleep 30 </dev/null >/dev/null 2>&1 &) ; exit 0')
    _tool(bin_dir, "runuser", 'shift 3; exec "$@"')  # runuser -u postgres -- psql ...
    _tool(bin_dir, "psql", 'case "$*" in *"select 1"*) echo 1 ;; *) echo "CREATE ROLE" ;; esac')
    _tool(bin_dir, "sudo", 'shift; exec "$@"')  # sudo -n CMD: as a non-root runner calls it
    return bin_dir


def test_the_url_alone_on_stdout_and_no_wait_for_the_server(tmp_path):
    if os.name != "posix":
        requires.skip("a bash script for Debian's postgresql", by_design=True)
    bin_dir = _standins(tmp_path)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    # as .ci/run calls it: stdout captured through a pipe; the stand-in daemon outlives the script by 30 s, so a
    # script that let it inherit the pipe would hold this call past its timeout
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "postgresql://h3kit_test:h3kit_test@127.0.0.1:5433/postgres\n"
    assert "Removed stale pid file." in proc.stderr and "starting cluster 15/main" in proc.stderr
