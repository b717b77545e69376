#!/usr/bin/env bash
# GPU check: on a machine with one NVIDIA GPU, in at most 9 minutes in all (with a machine
# start of a few minutes, inside a 15-minute device lease),
#   1. make sure speedbench and its test dependencies import (pip install -e ".[test]" if not),
#   2. run the gpu-marked tests,
#   3. run the experiments at scale=full, with bench settings chosen to fit the time left, in
#      three passes, most important first (a pass cut short by its time still has its trials):
#      a. the techniques people tune today (channels_last, TF32, cudnn.benchmark, optimizer
#         implementations, checkpointing, attention kernels, FSDP2) as one suite,
#      b. torch.compile: eager, default and reduce-overhead (CUDA graphs); max-autotune's
#         autotuning would take minutes of the budget alone, so it is left out here,
#      c. the rest of the tips suite (the articles' tips);
#      (without configs/experiment/tips.yaml: amp and every other experiment instead),
# and write everything under results/reference/<gpu-name>/ (not git-ignored: commit it).
#
#   scripts/gpu_check.sh                   # from anywhere; GPU_CHECK_BUDGET_S=540 by default
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
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

# One pass: "experiment [extra overrides]"; its share of the time left is in `shares` (percent).
new_techniques=attention,channels_last,checkpointing,cudnn_benchmark,matmul_precision,optimizer,fsdp
if [[ -f configs/experiment/tips.yaml && -f configs/experiment/compile.yaml ]]; then
  passes=("tips suite.experiments=[$new_techniques]"
          "compile ~variants.max_autotune"
          "tips suite.exclude=[$new_techniques,compile]")
  shares=(55 60 100)  # % of the time left when the pass starts (the last takes what remains)
elif [[ -f configs/experiment/tips.yaml ]]; then
  passes=(tips); shares=(100)
else
  passes=(amp $(ls configs/experiment/*.yaml | xargs -n1 basename | sed 's/\.yaml$//' | grep -vx amp))
  shares=(); for _ in "${passes[@]}"; do shares+=(0); done  # 0: an equal part of what is left
  say "configs/experiment/tips.yaml is absent: running ${passes[*]} instead" | tee -a "$log"
fi

suite_rc=0
for i in "${!passes[@]}"; do
  read -r exp extra <<< "${passes[$i]}"
  left=$((BUDGET_S - (SECONDS - start) - MARGIN_S))
  if (( ${shares[$i]} > 0 )); then
    share=$((left * ${shares[$i]} / 100))
  else
    share=$((left / (${#passes[@]} - i)))  # what is left, shared by the passes to come
  fi
  if (( share < 20 )); then
    say "no time left for $exp $extra" | tee -a "$log"; suite_rc=1; continue
  fi
  set -f  # the overrides' [a,b] lists are not file patterns
  # shellcheck disable=SC2086  # $extra and $bench are lists of overrides
  bench=$(python scripts/gpu_check_plan.py "$share" "$exp" scale=full device=cuda $extra 2>>"$log")
  say "+experiment=$exp $extra scale=full device=cuda $bench (within $share s)" | tee -a "$log"
  before=$(date +%s)
  # shellcheck disable=SC2086
  timeout --signal=INT --kill-after=10 "$share" \
    python -m speedbench "+experiment=$exp" $extra scale=full device=cuda $bench "out_dir=$out" \
    2>&1 | tee -a "$log" | grep -v '%|'
  rc=${PIPESTATUS[0]}
  set +f
  say "$exp: exit status $rc after $(( $(date +%s) - before )) s" | tee -a "$log"
  if (( rc != 0 )); then
    suite_rc=$rc
    # A run cut short still has its trials: rebuild its summary and report from them.
    run_dir=$(ls -dt "$out/$exp"/*/ 2>/dev/null | head -n1)
    if [[ -n "$run_dir" && -f "$run_dir/trials.csv" ]]; then
      python - "$run_dir" >> "$log" 2>&1 <<'PY' && say "summary and report rebuilt in $run_dir" | tee -a "$log"
import sys
from pathlib import Path
from speedbench import results
from speedbench.analysis.summary import summarised
from speedbench.report.render import write_report
from speedbench.results.runs import load_run
run_dir = Path(sys.argv[1])
run = load_run(run_dir)
run.summary = None  # rebuilt from the trials, as the report rebuilds it
results.write_summary(summarised(run).summary, run_dir)
write_report(run_dir)
PY
    fi
  fi
done

say "done: tests $tests_rc, suite $suite_rc; total $((SECONDS - start)) s of $BUDGET_S" | tee -a "$log"
(( tests_rc == 0 && suite_rc == 0 ))
