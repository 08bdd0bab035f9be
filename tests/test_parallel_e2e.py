"""Tensor parallel and 2-D (FSDP2 x TP) training through torchtitan on gloo processes,
with every low-bit state format."""

import pytest

from conftest import run_train, step_losses

pytestmark = pytest.mark.trainer  # every test here runs torchtitan's Trainer

STEPS = 3


def train(tmp_path, *overrides, nproc=2, check=True):
    return run_train("--training.steps", str(STEPS), "--validation.no-enable",
                     "--lr_scheduler.total_steps", "8", "--job.dump_folder", str(tmp_path),
                     *overrides, nproc=nproc, check=check)


# AdamW4bit with TP runs in test_fsdp_x_tensor_parallel_on_four_processes below (TP 2 x
# FSDP 2), so every low-bit format trains under tensor parallelism. The FP8 run keeps the
# (TP-sharded) embeddings and head in fp32 states ([lowbit] fp32_states).
@pytest.mark.parametrize("optimizer,fp32_states", [("AdamW8bit", ""), ("AdamWFp8", "tok_embeddings,output")])
def test_tensor_parallel_trains_with_every_format(optimizer, fp32_states, tmp_path, prepared_data):
    # debugmodel's attention.wo / feed_forward.w2 are 256 wide and split in 2 along their
    # last dimension: blocks of 128 keep every quantization block inside one shard.
    proc = train(tmp_path, "--parallelism.tensor_parallel_degree", "2",
                 "--optimizer.name", optimizer, "--lowbit.block_size", "128",
                 *(("--lowbit.fp32_states", fp32_states) if fp32_states else ()))
    losses = {s: float(l) for s, l in step_losses(proc.stdout).items()}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.4, losses
    if fp32_states:
        assert "state format fp8; fp32 states for 2 params" in proc.stdout, proc.stdout[-3000:]


def test_tensor_parallel_split_block_is_a_start_up_error(tmp_path, prepared_data):
    proc = train(tmp_path, "--parallelism.tensor_parallel_degree", "2",
                 "--optimizer.name", "AdamW8bit", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not step_losses(out)
    assert "layers.0.attention.wo.weight" in out and "block_size=128" in out, out[-3000:]


# BitNet's ternary weights learn slower in the first steps: a smaller required drop.
@pytest.mark.parametrize("converters, drop", [((), 0.4), (("--model.converters", "bitnet"), 0.25)],
                         ids=["plain", "bitnet"])
def test_fsdp_x_tensor_parallel_on_four_processes(converters, drop, tmp_path, prepared_data):
    # With BitNet: torchtitan's TP plan over BitNetLinear layers, the packed FSDP
    # all-gather of TP shards and the scale precompute over both mesh dimensions
    # (tests/test_bitnet_tp.py checks the math against the unsharded model).
    proc = train(tmp_path, "--parallelism.tensor_parallel_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "2",
                 "--optimizer.name", "AdamW4bit", "--lowbit.block_size", "128",
                 "--lowbit.weight_dtype", "bfloat16", "--lowbit.weight_update", "stochastic",
                 *converters, nproc=4)
    losses = {s: float(l) for s, l in step_losses(proc.stdout).items()}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - drop, losses
