#!/usr/bin/env bash
# The first run on a machine with accelerators (issue 45 item 8; docs/deployment.md, "The first hardware run"):
# doctor, parity per component, calibrate, and one long prompt through the server with its progress log, each step's
# output and exit status collected into one report. Nothing here has run on an NPU or a GPU yet: every figure it
# writes is the first measured on hardware.
#
#   tools/first-hardware-run.sh --comfy-home DIR --device-type npu|cuda --npu-count N [--workflow API.json]
#                               [--out DIR] [--nnodes 1]
#
# A failing step is recorded and the run goes on (the report is what a first run is for); the exit status is 1 when
# any step failed. H3KIT (default: h3kit) is the command that runs h3kit. --workflow: an API-format H3 workflow at
# the size to prove (768p / 15 s: 1344x768, 362 frames), with its models installed; without it the long prompt is
# skipped and the report says so.
set -u

H3KIT=${H3KIT:-h3kit}
HOME_DIR="" TYPE="" COUNT="" WORKFLOW="" OUT="" NNODES=1
while [ $# -gt 0 ]; do
  case "$1" in
    --comfy-home) HOME_DIR=$2; shift 2 ;;
    --device-type) TYPE=$2; shift 2 ;;
    --npu-count) COUNT=$2; shift 2 ;;
    --workflow) WORKFLOW=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --nnodes) NNODES=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "first-hardware-run: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$HOME_DIR" ] || [ -z "$TYPE" ] || [ -z "$COUNT" ]; then
  echo "first-hardware-run: --comfy-home, --device-type and --npu-count are required (see --help)" >&2; exit 2
fi
case "$TYPE" in npu|cuda) ;; *) echo "first-hardware-run: --device-type is npu or cuda (a CPU has h3kit demo)" >&2; exit 2 ;; esac
case "$COUNT" in 1|2|4|8) ;; *) echo "first-hardware-run: --npu-count is 1, 2, 4 or 8" >&2; exit 2 ;; esac
if [ -n "$WORKFLOW" ] && [ ! -f "$WORKFLOW" ]; then
  echo "first-hardware-run: --workflow $WORKFLOW: no such file" >&2; exit 2
fi
OUT=${OUT:-$HOME_DIR/.h3kit/first-run-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT" || exit 2
STEPS="$OUT/steps.tsv"
: > "$STEPS"
DEVICES=$(seq -s, 0 $((COUNT - 1)))

# step NAME CMD...: run CMD, its stdout to OUT/NAME.out, its stderr to OUT/NAME.err; one line in steps.tsv
step() {
  local name=$1; shift
  local t0=$(date +%s)
  echo "first-hardware-run: $name: $*" >&2
  "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$*" >> "$STEPS"
  return $rc
}

step doctor "$H3KIT" doctor --comfy-home "$HOME_DIR" --device-type "$TYPE" --devices "$DEVICES" --nnodes "$NNODES" --json
step plan "$H3KIT" plan --width 1344 --height 768 --frames 362 --npu-count "$COUNT" --json
# each group's HCCL buffer sized to its largest message, as the plan says (docs/multinpu.md, "Links, buffers ...")
BUFFERS=$(grep -o 'H3KIT_HCCL_BUFFSIZE=[0-9]*,[0-9]*' "$OUT/plan.out" | head -1)
if [ "$TYPE" = npu ] && [ -n "$BUFFERS" ] && [ -z "${H3KIT_HCCL_BUFFSIZE:-}" ]; then export "$BUFFERS"; fi
if [ "$COUNT" -gt 1 ]; then
  for component in dit te vae; do
    step "parity-$component" "$H3KIT" parity --comfy-home "$HOME_DIR" --component "$component" --device-type "$TYPE" \
      --npu-count "$COUNT" --transport process --json
  done
  step parity-dit-int8 "$H3KIT" parity --comfy-home "$HOME_DIR" --component dit --weights int8 --device-type "$TYPE" \
    --npu-count "$COUNT" --transport process --json
fi
step calibrate "$H3KIT" calibrate --comfy-home "$HOME_DIR" --device-type "$TYPE" --npu-count "$COUNT" \
  --out "$OUT/calibration.json" --json
if [ -n "$WORKFLOW" ]; then
  if step start "$H3KIT" start --comfy-home "$HOME_DIR" --device-type "$TYPE" --devices "$DEVICES" --json; then
    step long-prompt "$H3KIT" bench "$WORKFLOW" --comfy-home "$HOME_DIR" --runs 1 --npu-count "$COUNT" --json
    step server-log "$H3KIT" logs --comfy-home "$HOME_DIR"
    step stop "$H3KIT" stop --comfy-home "$HOME_DIR"
  fi
else
  printf 'long-prompt\tskipped\t0\tno --workflow given\n' >> "$STEPS"
fi

# the report: every step, its status and time, and the progress lines of the server log
{
  echo "# First hardware run: $(hostname), $TYPE x $COUNT, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "| step | exit | seconds | command |"
  echo "| --- | --- | --- | --- |"
  while IFS=$'\t' read -r name rc secs cmd; do echo "| $name | $rc | $secs | \`$cmd\` |"; done < "$STEPS"
  echo
  if [ -f "$OUT/server-log.out" ]; then
    echo "## Progress and link lines of the server log"
    echo
    echo '```'
    grep -E 'MultiNPU: .*(progress|collective|pair|generation .* ready|HCCL|hung|slow)' "$OUT/server-log.out" | tail -200
    echo '```'
  fi
  echo
  echo "Outputs of each step: $OUT/<step>.out and .err."
} > "$OUT/report.md"
echo "first-hardware-run: report in $OUT/report.md" >&2
! cut -f2 "$STEPS" | grep -qvE '^(0|skipped)$'
