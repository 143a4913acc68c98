#!/usr/bin/env bash
# make test: pytest in the ComfyUI environment (the main run) and, in parallel with it, the same tests on the
# other supported Pythons in small torch-free environments (tools/ensure-toolkit-venv.sh), where the tests
# that need torch skip by design (H3KIT_TORCH_FREE_RUN=1, tests/support/requires.py). Exits non-zero when
# any run fails.
#
#   tools/run-tests.sh MAIN_PYTHON [PYTEST_ARGS...]
#   H3KIT_TEST_PYTHONS   the other Pythons (default "3.10 3.13"; empty: the main run only)
#   H3KIT_TEST_WORKERS   pytest-xdist workers of the main run (default 3 on 2 cores: the process-group, fault
#                        and service files spend most of their time waiting on timeouts and heartbeats; one test
#                        file per worker at a time: a file's server and fixtures stay on one worker; 0: no xdist,
#                        for -s or --pdb)
set -uo pipefail
main_py=${1:?usage: tools/run-tests.sh MAIN_PYTHON [PYTEST_ARGS...]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
pythons=${H3KIT_TEST_PYTHONS-3.10 3.13}
logs=$(mktemp -d "${TMPDIR:-/tmp}/h3kit-tests.XXXXXX")
trap 'rm -rf "$logs"' EXIT

# Not in the torch-free runs: tests of h3kit's own logic that no Python version changes, which cost the most CPU
# there (hostile inputs and kills at random moments, each a fresh `python -m h3kit`; the patch engine's and the
# rebase's git trees: a torch-free run alone took 155 CPU-s with them, 76 without, 2026-12-02); the main run runs
# them. What stays is what a Python version can change: the CLI and every module imported, the service's processes
# and signals (test_service_standin), the wheel installed on that Python (test_wheel).
torch_free_skip=(--ignore=tests/test_probes.py --ignore=tests/test_crash_safety.py --ignore=tests/test_patch_engine.py
                 --ignore=tests/test_patches_rebase.py --ignore=tests/test_hostile_inputs.py)

# Only in the torch-free runs, when they run: the files none of whose tests needs torch (every one passes there, none
# skips; checked 2026-12-06), which exercise the toolkit alone: the CLI, the service's processes and signals against
# stand-ins, the front, the wheel. The two ends of the supported range (3.10, 3.13) run them; the main run's 3.11
# between them would add nothing and cost the most there: on the two cores every run shares, these files took 285 s
# of the main run's 3506 s of test time in a .ci/run of 2026-12-06 (22 min in all against the 15 the project allows;
# docs/performance.md, "CI"). With no torch-free run (TEST_PYTHONS empty), or with files named on the command line,
# the main run runs them.
toolkit_only=(tests/test_front.py tests/test_front_postgres.py tests/test_front_units.py tests/test_service_standin.py
              tests/test_service_servers.py tests/test_service_units.py tests/test_multinpu_status.py
              tests/test_models_fetch.py tests/test_models_first_hour.py tests/test_models_pinned.py
              tests/test_model_paths.py tests/test_wheel.py tests/test_json_shape.py tests/test_operator_papercuts.py
              tests/test_check_workflow.py tests/test_check_workflow_templates.py tests/test_first_hour.py
              tests/test_queuesave.py tests/test_parity_cli.py tests/test_test_policy.py)

# A selection made only of the files above leaves the torch-free runs nothing to run: they are not started
# (said below) rather than accepting pytest's exit 5, which would also hide a run that collected nothing by mistake.
selected=0; ignored_only=0
for a in "$@"; do
  case "$a" in
    tests/*.py|tests/*.py::*|./tests/*.py|./tests/*.py::*)
      selected=$((selected + 1))
      f=${a%%::*}; f=${f#./}
      for i in "${torch_free_skip[@]}"; do [ "$i" = "--ignore=$f" ] && ignored_only=$((ignored_only + 1)) && break; done ;;
  esac
done
if [ "$selected" -gt 0 ] && [ "$ignored_only" = "$selected" ]; then
  echo "tests: the torch-free runs are not started: the selection holds only files they leave to the main run (${torch_free_skip[*]})"
  pythons=""
fi

# The suite runs hundreds of torch processes on a few cores: OpenMP's threads, which by default spin for a while
# after each parallel region (libgomp's GOMP_SPINCOUNT), sleep instead, leaving the cores to the other processes.
# Results do not change; unset, each process would burn what the others wait for.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

# ports: every run takes them from the one allocator (tests/support/service_helpers.py free_port: reserved by a
# lock all runs share, checked by binding), so the parallel runs need no bands of their own
# Each torch-free environment is built (first time on a machine: ~25 s each) inside its run's background job, so the
# main run does not wait for it.
for v in $pythons; do
  ( start=$(date +%s)
    if py=$("$root/tools/ensure-toolkit-venv.sh" "$v" 2>"$logs/$v.log"); then
      # below the main run's priority: when both want the two cores, the main run's bounded tests (a fault named
      # within its bound) get them first
      H3KIT_TORCH_FREE_RUN=1 nice -n 5 "$py" -m pytest -p no:cacheprovider \
        "${torch_free_skip[@]}" "$@" \
        >>"$logs/$v.log" 2>&1
      echo "$? $(( $(date +%s) - start ))" >"$logs/$v.rc"
    else
      echo "ensure-toolkit-venv.sh $v failed" >>"$logs/$v.log"
      echo "1 $(( $(date +%s) - start ))" >"$logs/$v.rc"
    fi ) &
done

main_only=()
if [ -n "$pythons" ] && [ "$selected" -eq 0 ]; then
  for f in "${toolkit_only[@]}"; do main_only+=("--ignore=$f"); done
fi

start=$(date +%s)
# files in tests/conftest.py's order (the longest first), not xdist's default of the most tests first
"$main_py" -m pytest -n "${H3KIT_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder ${main_only[@]+"${main_only[@]}"} "$@"
rc=$?
echo "tests: main run (python $("$main_py" -c 'import platform; print(platform.python_version())')) took $(( $(date +%s) - start )) s"
wait
for v in $pythons; do
  read -r vrc secs <"$logs/$v.rc"
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$logs/$v.log" | tail -n 1 | tr -d '=' | xargs)
  # every exit but 0 fails, 5 (nothing collected) too: a torch-free run that ran nothing checked nothing
  if [ "$vrc" != 0 ]; then
    [ "$vrc" = 5 ] && echo "tests: python $v (torch-free run) collected no test (pytest exit 5): a selection it cannot run?"
    echo "tests: python $v (torch-free run) FAILED (exit $vrc, $secs s); its log:"
    tail -n 60 "$logs/$v.log"
    rc=1
  else
    echo "tests: python $v (torch-free run): ${summary:-no test selected} ($secs s)"
  fi
done
exit "$rc"
