#!/usr/bin/env bash
# Train with torchtitan + titan_lowbit from a TOML file, on GPUs or on the CPU.
#
#   scripts/train.sh CONFIG.toml [torchtitan overrides, e.g. --optimizer.name AdamW8bit]
#
# - prepares the offline tokenizer and dataset if missing (python -m titan_lowbit.prepare_data,
#   into $TITAN_LOWBIT_DATA, else ~/.cache/titan_lowbit/lowbit_text);
# - with GPUs: torchrun with one process per GPU (NGPU=N to use fewer);
# - without: NPROC (default 2) CPU processes on the gloo backend, running the real
#   torchtitan Trainer through titan_lowbit's CPU device path.
# Environment: NGPU, NPROC, LOG_RANK (ranks whose output is shown, default 0),
# TITAN_LOWBIT_DEVICE=cpu (force the CPU path). Each run takes a free port (torchrun --standalone).
set -euo pipefail

if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "usage: scripts/train.sh CONFIG.toml [torchtitan overrides...]" >&2
  [ $# -ge 1 ] && echo "error: config file '$1' not found" >&2
  exit 2
fi
config=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Relative paths in the configs (dump_folder = "./outputs/...") are from the repository
# root. Run from there, `python -m` finds this clone's titan_lowbit first (whole: its
# kernels are the symlink titan_lowbit/kernels), also beside a non-editable install.
cd "$root"
python=${PYTHON:-python3}

"$python" -m titan_lowbit.prepare_data --if-missing

ngpu=0
if [ "${TITAN_LOWBIT_DEVICE:-auto}" != "cpu" ]; then
  ngpu=$("$python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
fi
if [ "$ngpu" -gt 0 ]; then
  nproc=${NGPU:-$ngpu}
  echo "train.sh: $nproc GPU process(es)" >&2
else
  nproc=${NPROC:-2}
  export TITAN_LOWBIT_DEVICE=cpu
  # One thread per process so NPROC processes share the cores without oversubscribing.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  echo "train.sh: no GPU; $nproc CPU processes (gloo)" >&2
fi

# torchtitan colours its step lines with ANSI codes; written to a file or a pipe they are
# noise, so they are off there (an override after the config can turn them on again).
colour=()
[ -t 1 ] || colour=(--metrics.disable_color_printing)

exec "$python" -m torch.distributed.run --standalone --nproc_per_node="$nproc" \
  --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
  -m torchtitan.train --job.config_file "$config" ${colour[@]+"${colour[@]}"} "$@"
