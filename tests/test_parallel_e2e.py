"""Tensor parallel and 2-D (FSDP2 x TP) training through torchtitan on gloo processes,
with every low-bit state format, each against a run without tensor parallelism that reads
the same batches: their losses agree step for step. (A fall of the loss over a few steps
would not do: each step's loss is on another batch, and the batches are the interpreter's
standard library, another text under each Python version.)"""

import pytest

from conftest import SMALL_STEPS, run_train, step_losses

pytestmark = pytest.mark.trainer  # every test here runs torchtitan's Trainer

STEPS = 3
# How far the losses of a tensor-parallel run may be from those of its run without TP, at
# every step: sharded products add their partial sums in another order, and low-bit states
# round where torch's fp32 AdamW does not; together about 1e-4 over STEPS steps. Shards
# initialised alike (the CPU path before it drew DTensor's random fills whole) move step 1
# alone by about 0.05.
LOSS_TOL = 2e-3


def train(tmp_path, *overrides, nproc=2, check=True):
    return run_train("--training.steps", str(STEPS), "--validation.no-enable", *SMALL_STEPS,
                     "--lr_scheduler.total_steps", "8", "--job.dump_folder", str(tmp_path),
                     *overrides, nproc=nproc, check=check)


def losses(proc) -> dict[int, float]:
    found = {s: float(l) for s, l in step_losses(proc.stdout).items()}
    assert sorted(found) == list(range(1, STEPS + 1)), proc.stdout[-3000:]
    return found


def assert_same_losses(sharded: dict[int, float], reference: dict[int, float]) -> None:
    assert all(abs(sharded[s] - reference[s]) <= LOSS_TOL for s in reference), (sharded, reference)


@pytest.fixture(scope="module")
def one_process_adamw(tmp_path_factory, prepared_data) -> dict[int, float]:
    """torch's AdamW on one process: the batches a TP-only run (no data parallelism) reads."""
    return losses(train(tmp_path_factory.mktemp("one_process"), "--optimizer.name", "AdamW",
                        nproc=1))


# AdamW4bit with TP runs in test_fsdp_x_tensor_parallel_on_four_processes below (TP 2 x
# FSDP 2), so every low-bit format trains under tensor parallelism. The FP8 run keeps the
# (TP-sharded) embeddings and head in fp32 states ([lowbit] fp32_states).
@pytest.mark.parametrize("optimizer,fp32_states", [("AdamW8bit", ""), ("AdamWFp8", "tok_embeddings,output")])
def test_tensor_parallel_trains_like_one_process(optimizer, fp32_states, one_process_adamw, tmp_path):
    # debugmodel's attention.wo / feed_forward.w2 are 256 wide and split in 2 along their
    # last dimension: blocks of 128 keep every quantization block inside one shard.
    proc = train(tmp_path, "--parallelism.tensor_parallel_degree", "2",
                 "--optimizer.name", optimizer, "--lowbit.block_size", "128",
                 *(("--lowbit.fp32_states", fp32_states) if fp32_states else ()))
    assert_same_losses(losses(proc), one_process_adamw)
    if fp32_states:
        assert "state format fp8; fp32 states for 2 params" in proc.stdout, proc.stdout[-3000:]


def test_tensor_parallel_split_block_is_a_start_up_error(tmp_path, prepared_data):
    proc = train(tmp_path, "--parallelism.tensor_parallel_degree", "2",
                 "--optimizer.name", "AdamW8bit", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not step_losses(out)
    assert "layers.0.attention.wo.weight" in out and "block_size=128" in out, out[-3000:]


@pytest.mark.parametrize("converters", [(), ("--model.converters", "bitnet")], ids=["plain", "bitnet"])
def test_fsdp_x_tensor_parallel_on_four_processes(converters, tmp_path, prepared_data):
    # With BitNet: torchtitan's TP plan over BitNetLinear layers, the packed FSDP
    # all-gather of TP shards and the scale precompute over both mesh dimensions
    # (tests/test_bitnet_tp.py checks the math against the unsharded model). The run
    # without TP is FSDP2 on 2 processes: the same 2 data-parallel ranks, the same batches,
    # and stochastic rounding's streams do not depend on the sharding.
    common = ("--optimizer.name", "AdamW4bit", "--lowbit.block_size", "128",
              "--lowbit.weight_dtype", "bfloat16", "--lowbit.weight_update", "stochastic",
              *converters)
    sharded = train(tmp_path / "fsdp_x_tp", "--parallelism.tensor_parallel_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "2", *common, nproc=4)
    fsdp = train(tmp_path / "fsdp", *common, nproc=2)
    assert_same_losses(losses(sharded), losses(fsdp))
