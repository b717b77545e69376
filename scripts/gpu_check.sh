#!/usr/bin/env bash
# GPU check: on a machine with one NVIDIA GPU, in at most 8 minutes in all,
#   1. make sure speedbench and its test dependencies import (pip install -e ".[test]" if not),
#   2. run the gpu-marked tests,
#   3. run the tips suite (or, without configs/experiment/tips.yaml, amp and every other
#      experiment) at scale=full, with bench settings chosen to fit the time left,
# and write everything under results/reference/<gpu-name>/ (not git-ignored: commit it).
#
#   scripts/gpu_check.sh                   # from anywhere; GPU_CHECK_BUDGET_S=480 by default
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
MARGIN_S=30  # kept back for rebuilding a report after a suite that hit its time limit
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, installed or not
export PYTHONUNBUFFERED=1
start=$SECONDS
say() { echo "gpu_check [$((SECONDS - start)) s]: $*"; }

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi failed)" >&2; exit 1
fi
if ! python -c "import torch, torchvision, hydra, pandas, matplotlib, psutil, tqdm, pytest" 2>/dev/null; then
  say "installing speedbench and its test dependencies"
  pip install -q -e ".[test]" || { echo "gpu_check: pip install failed" >&2; exit 1; }
fi
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch $(python -c 'import torch; print(torch.__version__)') sees no CUDA device" >&2
  exit 1
fi

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 | head -n1 \
      | sed -E 's/[^A-Za-z0-9._-]+/_/g; s/^_+|_+$//g')
out="results/reference/${gpu:-unknown_gpu}"
mkdir -p "$out"
log="$out/gpu_check.log"
say "GPU ${gpu}; writing to $out" | tee "$log"
nvidia-smi >> "$log" 2>&1

say "gpu-marked tests" | tee -a "$log"
timeout 180 python -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}
say "gpu tests exit status $tests_rc" | tee -a "$log"

if [[ -f configs/experiment/tips.yaml ]]; then
  experiments=(tips)
else
  experiments=(amp $(ls configs/experiment/*.yaml | xargs -n1 basename | sed 's/\.yaml$//' | grep -vx amp))
  say "configs/experiment/tips.yaml is absent: running ${experiments[*]} instead" | tee -a "$log"
fi

suite_rc=0
for i in "${!experiments[@]}"; do
  exp=${experiments[$i]}
  left=$((BUDGET_S - (SECONDS - start) - MARGIN_S))
  share=$((left / (${#experiments[@]} - i)))  # what is left, shared by the experiments to come
  if (( share < 20 )); then
    say "no time left for $exp" | tee -a "$log"; suite_rc=1; continue
  fi
  bench=$(python scripts/gpu_check_plan.py "$share" "$exp" scale=full device=cuda 2>>"$log")
  say "+experiment=$exp scale=full device=cuda $bench (within $share s)" | tee -a "$log"
  before=$(date +%s)
  # shellcheck disable=SC2086  # $bench is a list of overrides
  timeout --signal=INT --kill-after=10 "$share" \
    python -m speedbench "+experiment=$exp" scale=full device=cuda $bench "out_dir=$out" 2>&1 \
    | tee -a "$log" | grep -v '%|'
  rc=${PIPESTATUS[0]}
  say "$exp: exit status $rc after $(( $(date +%s) - before )) s" | tee -a "$log"
  if (( rc != 0 )); then
    suite_rc=$rc
    # A run cut short still has its trials: rebuild its summary and report from them.
    run_dir=$(ls -dt "$out/$exp"/*/ 2>/dev/null | head -n1)
    if [[ -n "$run_dir" && -f "$run_dir/trials.csv" ]]; then
      python - "$run_dir" >> "$log" 2>&1 <<'PY' && say "summary and report rebuilt in $run_dir" | tee -a "$log"
import sys
from pathlib import Path
from speedbench import results, stats
from speedbench.report.render import write_report
run_dir = Path(sys.argv[1])
results.write_summary(stats.summarise(results.load_trials(run_dir)), run_dir)
write_report(run_dir)
PY
    fi
  fi
done

say "done: tests $tests_rc, suite $suite_rc; total $((SECONDS - start)) s of $BUDGET_S" | tee -a "$log"
(( tests_rc == 0 && suite_rc == 0 ))
