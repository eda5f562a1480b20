# The time-boxed run of a GPU script's items (sourced by tools/gpu/issue*.sh; docs/gpu.md):
# argument parsing, the install, each item under `timeout` with its own box until the
# budget is spent, one summary. The sourcing script defines, before `harness_main "$@"`:
#   SCRIPT    its name, for messages;      ISSUE   the issue, for the summary's first line;
#   LOGS      where the items' logs go;    ITEMS   "name box(s) min(s) what", priority order;
#   run_item NAME     the command of one item (its output goes to the item's log);
#   figures NAME LOG  the summary lines that carry the item's figures;
#   and, if it wants one, after_items (run once after the last item, not in a dry run).
# Its header comment (lines 2 to USAGE_LINES) is the usage text.
#
#   --budget   wall seconds for the whole script, install included (default 480). An item
#              runs only if at least its minimum is left, for at most min(its box, what is left).
#   --only     run only these items, in the order given (install always runs).
#   --dry-run  run nothing: print the plan as if every item used its whole box (checks the
#              argument parsing and the time-box arithmetic on a machine without a GPU).
# Writes $OUT/summary.txt (every figure, one screen; also printed at the end) and
# $OUT/logs.tar.gz (each item's full log; the device tool returns at most 8 files).

INSTALL_BOX=${INSTALL_BOX:-150}

harness_usage() {
  sed -n "2,${USAGE_LINES:-15}p" "$0" | sed 's/^# \{0,1\}//'
  printf '\nitems: '; for i in "${ITEMS[@]}"; do printf '%s ' "${i%% *}"; done; echo
}

harness_main() {
  local budget=480 only="" dry=0
  while [ $# -gt 0 ]; do
    case $1 in
      --budget) budget=${2:-}; shift 2 || { harness_usage >&2; exit 2; } ;;
      --budget=*) budget=${1#*=}; shift ;;
      --only) only=${2:-}; shift 2 || { harness_usage >&2; exit 2; } ;;
      --only=*) only=${1#*=}; shift ;;
      --dry-run) dry=1; shift ;;
      -h|--help) harness_usage; exit 0 ;;
      *) echo "$SCRIPT: unknown argument '$1'" >&2; harness_usage >&2; exit 2 ;;
    esac
  done
  [[ $budget =~ ^[0-9]+$ ]] && [ "$budget" -gt 0 ] || {
    echo "$SCRIPT: --budget takes whole seconds > 0, got '$budget'" >&2; exit 2; }
  local names=" " n i
  for i in "${ITEMS[@]}"; do names+="${i%% *} "; done
  for n in ${only//,/ }; do
    [[ $names == *" $n "* ]] || { echo "$SCRIPT: unknown item '$n' (items:$names)" >&2; exit 2; }
  done

  cd "$(dirname "$0")/../.."
  OUT=${OUT:-/tmp/out}; export M=/tmp/models
  mkdir -p "$OUT" "$LOGS"
  summary=$OUT/summary.txt; : > "$summary"
  start=$SECONDS spent_dry=0
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0 FORK_MODELS=$M
  export -f run_item

  say "$ISSUE, $(date -u +%FT%TZ), budget ${budget}s$( ((dry)) && echo ', DRY RUN')"
  local install_ok rc
  # --- install (always; nothing else runs without it)
  if ((dry)); then
    say "install: dry-run, box ${INSTALL_BOX}s"; spent_dry=$INSTALL_BOX; install_ok=1
  else
    timeout -k 10 "$INSTALL_BOX" bash -c '
      set -e
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      bash tools/gpu/install.sh
      [ -e /tmp/models/.done ] || { python3 tools/gpu/make_models.py /tmp/models && touch /tmp/models/.done; }
      python3 -c "import torch, transformers, triton, vllm; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__, \"vllm\", vllm.__version__)"
      # NOTE: the extensions load here or not at all: one failure instead of one per item.
      python3 -c "import vllm._C, vllm._C_stable_libtorch; from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported as s; print(\"FA3\", s(3))"
    ' > "$LOGS/install.log" 2>&1
    rc=$?; install_ok=$(( rc == 0 ))
    say "install: rc=$rc ($(elapsed)s) | $(head -1 "$LOGS/install.log") | $(grep -E '^torch ' "$LOGS/install.log" | tail -1) | $(grep -E '^FA3 ' "$LOGS/install.log" | tail -1)"
    say "  $(grep -E '^install: ' "$LOGS/install.log" | tail -1)"
    ((install_ok)) || { tail -5 "$LOGS/install.log" | cut -c1-200 >> "$summary"; }
  fi
  pack_logs

  local name box min what left t t0 note line order=()
  # NOTE: --only also orders: a later issue runs the same items in its own priority.
  if [ -n "$only" ]; then
    for n in ${only//,/ }; do
      for i in "${ITEMS[@]}"; do [ "${i%% *}" = "$n" ] && order+=("$i"); done
    done
  else order=("${ITEMS[@]}"); fi
  for i in "${order[@]}"; do
    read -r name box min what <<< "$i"
    left=$(( budget - $(elapsed) ))
    if ! ((install_ok)); then say "$name: skipped (install failed) - $what"; continue; fi
    if (( left < min )); then say "$name: skipped (${left}s left < ${min}s) - $what"; continue; fi
    t=$(( box < left ? box : left ))
    if ((dry)); then say "$name: dry-run, would run <= ${t}s (box $box, ${left}s left) - $what"
      spent_dry=$(( spent_dry + t )); continue; fi
    t0=$SECONDS
    # NOTE: GNU timeout signals its whole process group: pytest, an engine and its workers.
    timeout -k 10 "$t" bash -c 'run_item "$1"' _ "$name" > "$LOGS/$name.log" 2>&1
    rc=$?
    note=""; ((rc == 124 || rc == 137)) && note=", stopped at its ${t}s box"
    say "$name: rc=$rc ($(( SECONDS - t0 ))s$note) - $what"
    figures "$name" "$LOGS/$name.log" | while IFS= read -r line; do say "  $line"; done
    pack_logs
  done
  if ! ((dry)) && declare -F after_items > /dev/null; then after_items; fi
  say "total $(elapsed)s of ${budget}s"
  pack_logs
  cat "$summary"
  ((install_ok))
}

# NOTE: a dry run counts only the boxes it plans, never its own wall time (a loaded
# machine took a second over it: 'total 481s of 480s' in a fresh-clone CI run).
elapsed() { if ((dry)); then echo "$spent_dry"; else echo $(( SECONDS - start )); fi; }
say() { echo "$*" | cut -c1-200 >> "$summary"; }
pack_logs() { tar czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; }
