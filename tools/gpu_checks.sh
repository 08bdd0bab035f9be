#!/usr/bin/env bash
# Every check that needs a GPU, in one command, on the GPUs of this host:
#
#   tools/gpu_checks.sh [CHECK...]      (no CHECK: all of them)
#
#   tests   README's test command, `python -m pytest` (PYTEST_ARGS are added, e.g.
#           PYTEST_ARGS=--ignore=tests/test_packaging.py on a host without a package
#           index): the kernels run compiled on the GPU, the CUDA-only tests run, the
#           CPU-path tests run on the CPU beside them (1 GPU)
#   compat  the runs behind docs/compatibility.md's GPU cells, each a resume check:
#           compile with bf16 weights (1 GPU); Muon4bit with a rank-8 momentum factor, bf16
#           weights, FSDP2 (2 GPUs: the factor made at each matrix's owner over NCCL); float8
#           linears with AdamW8bit, fp32
#           weights and bf16 weights, and with Muon8bit, bf16 weights, FSDP2 (2 GPUs,
#           torchao installed)
#   bitnet  BitNet resumes bit for bit over NCCL: the debug model under TP 2 with
#           AdamW8bit + bf16 master_remainder, blocks of 128 (TP splits its 256-wide rows
#           in two) (2 GPUs); llama3 1B under FSDP2 over 4 GPUs
#           with torch's AdamW and FSDP2 2 x TP 2 with AdamW8bit + master_remainder (4 GPUs;
#           docs/bitnet.md)
#
# A check that needs more GPUs than the host has, or torchao where it is missing, is
# reported as skipped with the reason. Each resume check's logs go to LOGS (default
# outputs/gpu_checks), the test output to LOGS/tests.log. One line per check at the end;
# the exit status is 1 if any check failed, 2 if there is no GPU.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
export LOGS=${LOGS:-outputs/gpu_checks}
mkdir -p "$LOGS"

checks=("$@")
[ ${#checks[@]} -eq 0 ] && checks=(tests compat bitnet)
for c in "${checks[@]}"; do
  case $c in tests|compat|bitnet) ;; *) echo "gpu_checks: unknown check '$c' (tests, compat, bitnet)" >&2; exit 2 ;; esac
done
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$gpus" -eq 0 ]; then
  echo "gpu_checks: this host has no GPU torch can use; the CPU tests are README's test command" >&2
  exit 2
fi

summary=()
failed=0
record() {  # name, status, seconds
  summary+=("$(printf '%-14s %-60s %5ss' "$1" "$2" "$3")")
  case $2 in failed*) failed=1 ;; esac
}
needs() {  # name, GPUs needed: true if the host has them, else records the skip
  if [ "$gpus" -lt "$2" ]; then
    record "$1" "skipped: needs $2 GPUs, this host has $gpus" 0
    return 1
  fi
}
resume() {  # name, GPUs, then resume_check.sh's CONFIG and overrides
  local name=$1 n=$2 t0=$SECONDS
  shift 2
  needs "$name" "$n" || return 0
  if NGPU=$n tools/resume_check.sh "$name" "$@" > "$LOGS/$name.out" 2>&1; then
    record "$name" "passed: $(head -1 "$LOGS/$name.out" | sed 's/^[^:]*: //')" $((SECONDS - t0))
  else
    record "$name" "failed: see $LOGS/$name.out" $((SECONDS - t0))
  fi
}

debug=train_configs/llama3_debug.toml
seeded=(--debug.seed 0 --debug.deterministic)
a8sr=(--optimizer.name AdamW8bit --lowbit.weight_dtype bfloat16 --lowbit.weight_update stochastic)
float8=(--model.converters quantize.linear.float8 --quantize.linear.float8.enable_fsdp_float8_all_gather)
bitnet=(train_configs/llama3_1b_bitnet.toml --compile.no-enable "${seeded[@]}" --lr_scheduler.warmup_steps 2
        --lr_scheduler.min_lr_factor 1.0 --metrics.log_freq 1 --validation.no-enable)

for c in "${checks[@]}"; do
  case $c in
    tests)
      t0=$SECONDS
      # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
      if "$python" -m pytest ${PYTEST_ARGS:-} > "$LOGS/tests.log" 2>&1; then
        record tests "passed: $(tail -1 "$LOGS/tests.log" | tr -d '=' | sed 's/^ *//')" $((SECONDS - t0))
      else
        record tests "failed: see $LOGS/tests.log" $((SECONDS - t0))
      fi ;;
    compat)
      resume compile_bf16 1 $debug "${seeded[@]}" --compile.enable "${a8sr[@]}"
      resume muon4_factor 2 $debug "${seeded[@]}" --optimizer.name Muon4bit --optimizer.lr 1e-2 \
        --lowbit.muon_4bit_factor_rank 8 --lowbit.weight_dtype bfloat16 --lowbit.weight_update stochastic
      if "$python" -c "import torchao" 2>/dev/null; then
        resume float8_fp32 2 $debug "${seeded[@]}" "${float8[@]}" --optimizer.name AdamW8bit
        resume float8_bf16 2 $debug "${seeded[@]}" --compile.enable "${float8[@]}" \
          --quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp "${a8sr[@]}"
        resume float8_muon8 2 $debug "${seeded[@]}" --compile.enable "${float8[@]}" \
          --quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp --optimizer.name Muon8bit \
          --optimizer.lr 1e-2 --lowbit.weight_dtype bfloat16 --lowbit.weight_update master_remainder
      else
        record float8 "skipped: torchao is not installed" 0
      fi ;;
    bitnet)
      resume bitnet_tp2 2 train_configs/llama3_debug_bitnet.toml "${seeded[@]}" --compile.no-enable --lowbit.block_size 128 \
        --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 \
        --optimizer.name AdamW8bit --lowbit.weight_dtype bfloat16 --lowbit.weight_update master_remainder
      STEPS=10 resume bitnet_fsdp4 4 "${bitnet[@]}" --parallelism.data_parallel_shard_degree 4
      STEPS=10 resume bitnet_fsdp2_tp2 4 "${bitnet[@]}" --parallelism.data_parallel_shard_degree 2 \
        --parallelism.tensor_parallel_degree 2 --optimizer.name AdamW8bit --lowbit.weight_dtype bfloat16 \
        --lowbit.weight_update master_remainder ;;
  esac
done

echo "gpu_checks on $gpus GPU(s) ($("$python" -c 'import torch; print(torch.cuda.get_device_name(0))')):"
printf '  %s\n' "${summary[@]}"
exit $failed
