#!/usr/bin/env bash
# Does a resumed run continue exactly where the uninterrupted one went? On whatever
# scripts/train.sh runs on (GPUs, or CPU processes):
#   1. CONFIG for --steps steps (default 20) with a checkpoint every --steps/2 steps;
#   2. the last checkpoint removed, the same command again: it resumes from the middle one;
#   3. the two runs' losses of the resumed steps compared as torchtitan prints them.
# Exits 1 if the runs differ or the second run did not resume.
#
#   tools/resume_check.sh NAME CONFIG [torchtitan overrides...]
#   tools/resume_check.sh a8sr train_configs/llama3_debug.toml --debug.deterministic \
#       --optimizer.name AdamW8bit --lowbit.weight_dtype bfloat16 --lowbit.weight_update stochastic
#
# Environment: STEPS (default 20), LOGS (default outputs/resume_check): the runs' logs go to
# LOGS/NAME_full.log and LOGS/NAME_resumed.log, their dump folder is LOGS/NAME.
# On GPUs pass --debug.deterministic (torch's deterministic algorithms): without it torch
# does not promise that two runs repeat each other bit for bit.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: tools/resume_check.sh NAME CONFIG [torchtitan overrides...]" >&2
  exit 2
fi
name=$1 config=$2
shift 2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
steps=${STEPS:-20}
half=$((steps / 2))
logs=${LOGS:-outputs/resume_check}
dump=$logs/$name
rm -rf "$dump"
mkdir -p "$logs"
common=(--job.dump_folder "$dump" --checkpoint.enable --checkpoint.interval "$half"
        --checkpoint.no-last-save-model-only --training.steps "$steps"
        --metrics.disable_color_printing "$@")
scripts/train.sh "$config" "${common[@]}" > "$logs/${name}_full.log" 2>&1 \
  || { tail -80 "$logs/${name}_full.log"; exit 1; }
[ -d "$dump/checkpoint/step-$half" ] || { echo "resume_check: no checkpoint at step $half" >&2; exit 1; }
rm -rf "$dump/checkpoint/step-$steps"
scripts/train.sh "$config" "${common[@]}" > "$logs/${name}_resumed.log" 2>&1 \
  || { tail -80 "$logs/${name}_resumed.log"; exit 1; }
"${PYTHON:-python3}" - "$logs/${name}_full.log" "$logs/${name}_resumed.log" "$name" "$half" "$steps" <<'PY'
import sys
sys.path.insert(0, "scripts")  # the repository root is the working directory
from run_logs import step_losses
full_log, resumed_log, name, half, steps = sys.argv[1:4] + [int(a) for a in sys.argv[4:6]]
text = open(resumed_log).read()
full, resumed = step_losses(open(full_log).read()), step_losses(text)
resumed_ok = "Loading the checkpoint" in text and sorted(resumed) == list(range(half + 1, steps + 1))
same = resumed_ok and all(resumed[s] == full.get(s) for s in resumed)
print(f"{name}: loss {full.get(1)} -> {full.get(steps)}; resumed from step {half}: {resumed_ok}; "
      f"steps {half + 1}-{steps} identical: {same}")
print("  step: full / resumed  " + "  ".join(f"{s}: {full.get(s)} / {resumed[s]}" for s in sorted(resumed)))
sys.exit(0 if same else 1)
PY
