"""End to end: the real torchtitan Trainer on 2 CPU processes (gloo), through
scripts/train.sh, on train_configs/llama3_debug.toml and the offline corpus.

For every optimizer state format and BF16 update mode: the loss falls, and a run that
saves a DCP checkpoint at step N and is resumed from it gives the same per-step losses
as the uninterrupted run (stochastic rounding's generator, Kahan buffers and master
weights included), while the optimizer part of the checkpoint holds quantized tensors.
"""

import json
import math
import os
import re
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from conftest import (DEBUG_CONFIG, LAUNCHER_VARIABLE, ROOT, check_health_reported, resume_folder,
                      run_once_more_after_teardown_abort, run_train, step_losses)
from fork_launcher import WAITED_FOR_OTHER_RANKS

from titan_lowbit.torchtitan import cpu_device
from titan_lowbit.torchtitan.lr_schedule import SCHEDULE_FILE

pytestmark = pytest.mark.trainer  # every test here runs torchtitan's Trainer

STEPS = 4
HALF = STEPS // 2

# (optimizer name, [lowbit] weight_dtype, [lowbit] weight_update, [lowbit] fp32_states, more
# arguments):
# every state format (fp32 via torch, fp8, 8-bit, 4-bit) and every BF16 update rule, each
# at least once, within CI's time (titan_lowbit's own fp32 and bf16 states resume
# bit-identically in tests/test_optim_adamw.py and, through DCP, in
# tests/test_optim_fsdp.py); the 8-bit run keeps the embeddings and the head in fp32
# states (one optimizer of two state formats). Muon8bit: the matrices sharded by FSDP2 and
# orthogonalised whole by their owner ranks, the rest stepped by its inner AdamW. The fp8
# run reports the optimizer's health ([lowbit] health_metrics) to the log and TensorBoard.
HEALTH = ("--lowbit.health_metrics", "--metrics.enable_tensorboard")
VARIANTS = [
    ("AdamW", "auto", "nearest", "", ()),          # torch's AdamW, as torchtitan builds it
    ("AdamWFp8", "bfloat16", "kahan", "", HEALTH),
    ("AdamW8bit", "bfloat16", "stochastic", "tok_embeddings,output", ()),
    ("AdamW4bit", "bfloat16", "master", "", ()),
    # Muon's 8-bit momentum, its inner AdamW's moments. Its update's RMS is AdamW's settled
    # one (0.2 lr), below AdamW's first steps (about lr): a larger lr falls as far in STEPS steps.
    ("Muon8bit", "bfloat16", "stochastic", "", ("--optimizer.lr", "1e-2")),
]
FP32_STATES_LINE = re.compile(r"fp32 states for (\d+) params, [0-9.]+% of the elements, by \[lowbit\] fp32_states")
STATE_BYTES = re.compile(r"optimizer state ([0-9.]+) B/param")
PARAMS = re.compile(r"size: ([0-9,]+) total parameters")
def optimizer_state_storage(checkpoint) -> tuple[int, int, int]:
    """(bytes on disk, tensor payload bytes, items) of the optimizer's state tensors in a
    DCP checkpoint (``optimizer.state.*``; the per-parameter hyperparameters under
    ``optimizer.param_groups.*`` are not state). On disk = payload + a fixed
    serialization header per item."""
    meta = FileSystemReader(str(checkpoint)).read_metadata()
    on_disk = payload = items = 0
    for index, info in meta.storage_data.items():
        if not index.fqn.startswith("optimizer.state."):
            continue
        tensor_meta = meta.state_dict_metadata[index.fqn]
        chunk = next(c for c in tensor_meta.chunks if tuple(c.offsets) == tuple(index.offset))
        itemsize = torch.empty(0, dtype=tensor_meta.properties.dtype).element_size()
        on_disk += info.length
        payload += math.prod(chunk.sizes) * itemsize
        items += 1
    return on_disk, payload, items


def run_overrides(optimizer, dtype, update, fp32_states, more) -> tuple[str, ...]:
    """The flags of a VARIANTS row's run: STEPS steps, a checkpoint every HALF steps (its
    dump folder aside)."""
    return ("--optimizer.name", optimizer, "--lowbit.weight_dtype", dtype,
            "--lowbit.weight_update", update, "--lr_scheduler.total_steps", str(STEPS),
            "--validation.no-enable", "--checkpoint.enable", "--checkpoint.interval", str(HALF),
            *(("--lowbit.fp32_states", fp32_states) if fp32_states else ()), *more,
            "--training.steps", str(STEPS))


@pytest.mark.parametrize("optimizer,dtype,update,fp32_states,more", VARIANTS,
                         ids=["-".join(filter(None, v[:4])) for v in VARIANTS])
def test_loss_falls_and_checkpoint_resumes_identically(optimizer, dtype, update, fp32_states, more,
                                                       tmp_path, shared_run):
    common = run_overrides(optimizer, dtype, update, fp32_states, more)

    # One uninterrupted run that also writes a checkpoint at step HALF (shared: the torch
    # AdamW run is the one test_checkpoint_convert resumes as AdamW8bit).
    dump, proc = shared_run(*common)
    full = step_losses(proc.stdout)
    # the CPU path prints none of the warnings that are wrong there (cpu_device.quiet)
    noise = [line for line in (proc.stdout + proc.stderr).splitlines()
             if any(f in line for f in (*cpu_device.CPU_PATH_NOISE, "may not have complete support on cpu",
                                        "model.safetensors.index.json not found", "\x1b[",
                                        "Set timeout is now only supported"))]
    assert not noise, noise
    if os.environ.get(LAUNCHER_VARIABLE, "fork") == "fork":
        # rank 0 waited for the other rank's exit, not torchtitan's 2 s (tests/fork_launcher.py)
        assert WAITED_FOR_OTHER_RANKS in proc.stderr, proc.stderr[-3000:]
    assert sorted(full) == list(range(1, STEPS + 1)), full
    first, last = float(full[1]), [float(full[s]) for s in range(STEPS - 1, STEPS + 1)]
    assert sum(last) / len(last) < first - 0.5, f"loss did not fall: {full}"
    if HEALTH[0] in more:
        check_health_reported(proc.stdout, dump / "tb", STEPS)
    else:  # off by default
        assert "titan_lowbit health" not in proc.stdout

    ckpt_dir = dump / "checkpoint"
    assert (ckpt_dir / f"step-{HALF}").is_dir(), proc.stdout[-3000:]
    # The optimizer part of the checkpoint is the in-memory state (codes and scales), not
    # a dequantized copy: at most 1.1x the state bytes the optimizer reports.
    state_bytes = float(STATE_BYTES.search(proc.stdout).group(1))
    n_params = int(PARAMS.search(proc.stdout).group(1).replace(",", ""))
    on_disk, payload, items = optimizer_state_storage(ckpt_dir / f"step-{HALF}")
    assert payload <= 1.1 * state_bytes * n_params, (payload, state_bytes * n_params)
    assert on_disk <= payload + 2048 * items, (on_disk, payload, items)
    if fp32_states:
        # the selected parameters' states are fp32 moments, the others' 8-bit codes, and
        # the start-up line's B/param is the mixed figure the checkpoint holds
        meta = FileSystemReader(str(ckpt_dir / f"step-{HALF}")).read_metadata().state_dict_metadata
        for fqn in ("tok_embeddings.weight", "output.weight"):
            assert meta[f"optimizer.state.{fqn}.exp_avg"].properties.dtype == torch.float32, fqn
        assert "optimizer.state.layers.0.attention.wq.weight.exp_avg_codes" in meta
        assert FP32_STATES_LINE.search(proc.stdout).group(1) == "2", proc.stdout[-3000:]
        assert abs(payload / n_params - state_bytes) < 1e-3, (payload / n_params, state_bytes)

    # Resume from step HALF, in a folder of its own where that is the only checkpoint.
    resumed_dump = resume_folder(tmp_path, ckpt_dir, HALF)
    resumed_proc = run_train(*common, "--job.dump_folder", str(resumed_dump))
    out = resumed_proc.stdout + resumed_proc.stderr
    assert f"Loading the checkpoint from {resumed_dump / 'checkpoint' / f'step-{HALF}'}" in out, out[-3000:]
    # the checkpoint keeps the LR schedule's settings; the same ones resume without a word
    settings = json.loads((ckpt_dir / f"step-{HALF}" / SCHEDULE_FILE).read_text())
    assert settings["lr_scheduler.total_steps"] == STEPS, settings
    assert "learning-rate schedule differs" not in out
    resumed = step_losses(resumed_proc.stdout)
    assert sorted(resumed) == list(range(HALF + 1, STEPS + 1)), resumed
    assert resumed == {s: full[s] for s in resumed}, (
        f"resumed run differs:\nfull    {full}\nresumed {resumed}")


def test_resume_check_script(tmp_path, prepared_data):
    """tools/resume_check.sh (docs/training.md) on the CPU path: two steps, a checkpoint
    after the first, the resumed second step equal to the uninterrupted one."""
    env = dict(os.environ, TITAN_LOWBIT_DEVICE="cpu", NPROC="2", PYTHON=sys.executable,
               STEPS="2", LOGS=str(tmp_path))
    cmd = ["bash", str(ROOT / "tools" / "resume_check.sh"), "sr", str(DEBUG_CONFIG),
           "--optimizer.name", "AdamW4bit", "--lowbit.weight_dtype", "bfloat16",
           "--lowbit.weight_update", "stochastic", "--validation.freq", "1000"]
    proc = run_once_more_after_teardown_abort(cmd, env, timeout=600, nproc=2)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "resumed from step 1: True; steps 2-2 identical: True" in proc.stdout, proc.stdout
    assert "Loading the checkpoint" in (tmp_path / "sr_resumed.log").read_text()
