#!/usr/bin/env bash
# Build once, then reuse, a small environment (toolkit dependencies and pytest; no torch, no ComfyUI) on
# another Python the toolkit supports, for the tests that need no torch. Prints its python on stdout;
# everything else goes to stderr.
#
#   tools/ensure-toolkit-venv.sh 3.10      (or 3.13)
#
# The interpreter is python3.X on PATH when it runs, else the newest pyenv 3.X. The environment (about
# 60 MB) lives under H3KIT_CACHE (default ~/.cache/h3kit), keyed by the Python version and the hash of
# toolkit/requirements/toolkit-only.txt; an interrupted build is detected by a missing marker and redone.
set -euo pipefail
version=${1:?usage: tools/ensure-toolkit-venv.sh PYTHON_VERSION (e.g. 3.10)}
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${H3KIT_CACHE:-$HOME/.cache/h3kit}
req=$root/toolkit/requirements/toolkit-only.txt
say() { printf 'ensure-toolkit-venv: %s\n' "$*" >&2; }

find_python() {
  if "python$version" -c 'pass' >/dev/null 2>&1; then command -v "python$version"; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E "^${version//./\\.}(\.[0-9]+)?$" | sort -V | tail -n 1)
    [ -n "$v" ] && [ -x "$(pyenv root)/versions/$v/bin/python$version" ] && { echo "$(pyenv root)/versions/$v/bin/python$version"; return; }
  fi
  return 1
}

key=$(cat "$req" | sha256sum | cut -c1-12)
venv=$cache/toolkit-py$version-$key
mkdir -p "$cache"
exec 9>"$cache/.toolkit-py$version-$key.lock"
flock 9   # parallel callers wait for one build

if [ ! -f "$venv/.h3kit-complete" ]; then
  base=$(find_python) || { say "no Python $version found (python$version on PATH or a pyenv $version)"; exit 1; }
  say "building the Python $version toolkit environment in $venv (once)"
  rm -rf "$venv"
  "$base" -m venv "$venv"
  log=$cache/.toolkit-py$version-$key.build.log
  "$venv/bin/python" -m pip install -q -r "$req" >"$log" 2>&1 \
    || { tail -n 40 "$log" >&2; say "building the environment failed (log: $log)"; exit 1; }
  "$venv/bin/python" -c 'import click, psutil, yaml, websocket, packaging, pytest' >&2
  touch "$venv/.h3kit-complete"
fi
echo "$venv/bin/python"
