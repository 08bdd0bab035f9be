"""torchtitan's other meshes and optimizer containers with all three titan_lowbit features at
once (BitNet linears, AdamW8bit states, bf16 weights with stochastic rounding), on gloo
processes: each run trains, resumes from a checkpoint bit for bit, and, where the mesh
changes the checkpoint's layout, its checkpoint loads exactly on a plain FSDP2 mesh
(tests/reshard_check.py).

- HSDP 2 x 2 (``data_parallel_replicate_degree`` 2 x ``data_parallel_shard_degree`` 2):
  the last save is a Hugging Face export (``[checkpoint] last_save_in_hf``);
- pipeline parallelism 2 x FSDP2 2 with an interleaved schedule (two model parts, so two
  optimizers, per rank; ``[lowbit] fp32_states`` names parameters of the first and of the
  last stage): it trains and its checkpoint reshards onto FSDP2, but a resume on the
  pipeline mesh is refused before it would hang;
- ``[optimizer] early_step_in_backward`` on FSDP2 2 (one optimizer per parameter);
- Muon8bit (Muon for the matrices, its inner AdamW8bit for the rest) with bf16 weights on
  HSDP 2 x 2 with the model compiled (Inductor's C++ backend on the CPU path) and full
  activation checkpointing, and on FSDP2 2 x TP 2 with BitNet linears.
"""

import shutil

import pytest
import torch

from conftest import DEBUG_CONFIG, SMALL_STEPS, reshard_check, run_train, step_losses

pytestmark = pytest.mark.trainer  # every test here runs torchtitan's Trainer

STEPS, SAVE = 3, 2  # the resumed run's step and its last checkpoint are compared whole
# The runs whose checks do not need the loss to fall by a given margin (pipeline
# parallelism, Muon) take conftest.SMALL_STEPS: smaller batches, whose loss falls slower.
ALL_THREE = ("--model.converters", "bitnet", "--optimizer.name", "AdamW8bit",
             "--lowbit.weight_dtype", "bfloat16", "--lowbit.weight_update", "stochastic")


def straight_and_resumed(dump, *overrides, nproc, straight=(), resumed=(), features=ALL_THREE):
    """A run of STEPS steps with ``features`` that saves at SAVE and STEPS (extra flags
    ``straight``), its last checkpoint moved to ``dump/straight-step-STEPS``, then the same
    run resumed from step SAVE (extra flags ``resumed``). Returns the two runs' outputs."""
    common = ("--training.steps", str(STEPS), "--lr_scheduler.total_steps", "8",
              "--validation.no-enable", "--job.dump_folder", str(dump), "--checkpoint.enable",
              "--checkpoint.interval", str(SAVE), *features, *overrides)
    first = run_train(*common, *straight, nproc=nproc)
    shutil.move(dump / "checkpoint" / f"step-{STEPS}", dump / f"straight-step-{STEPS}")
    second = run_train(*common, *resumed, nproc=nproc)
    out = second.stdout + second.stderr
    assert f"Loading the checkpoint from {dump / 'checkpoint' / f'step-{SAVE}'}" in out, out[-3000:]
    return first.stdout, second.stdout


def dcp_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint folder, by its flattened key."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(folder), f"{tmp}/ckpt.pt")
        saved = torch.load(f"{tmp}/ckpt.pt", weights_only=False)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
    walk("", saved)
    return flat


def reshards_onto_fsdp(dump, *overrides, features=ALL_THREE):
    """The step-SAVE checkpoint of a run with ``features`` loads on 2 processes, FSDP2
    only, every model and optimizer tensor equal to the checkpoint's
    (tests/reshard_check.py)."""
    argv = ["--job.config_file", str(DEBUG_CONFIG), "--validation.no-enable",
            "--job.dump_folder", str(dump), "--checkpoint.enable", *features, *overrides,
            "--checkpoint.exclude_from_loading", "dataloader"]
    check = reshard_check(2, str(dump / "checkpoint"), str(SAVE), *argv)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-4000:]
    assert "RESHARD OK" in check.stdout and "on 2 processes" in check.stdout


def resumed_ends_where_straight_ended(dump) -> dict[str, torch.Tensor]:
    """The resumed run's last checkpoint equals the straight run's in every model and
    optimizer tensor (so the resumed run took the straight run's last step too, which no
    logged loss shows); returns the straight run's."""
    last = dcp_tensors(dump / f"straight-step-{STEPS}")
    resumed = dcp_tensors(dump / "checkpoint" / f"step-{STEPS}")
    assert resumed.keys() == last.keys()
    differ = [k for k in last if not torch.equal(last[k], resumed[k])]
    assert not differ, differ[:10]
    return last


def hf_export(folder) -> dict[str, torch.Tensor]:
    """The model of a Hugging Face export (``last_save_in_hf``), in torchtitan's names."""
    from safetensors.torch import load_file
    from torchtitan.protocols.train_spec import get_train_spec

    hf = {}
    for f in sorted(folder.glob("*.safetensors")):
        hf.update(load_file(f))
    assert hf, f"no safetensors file in {folder}: {sorted(p.name for p in folder.iterdir())}"
    spec = get_train_spec("llama3")
    return spec.state_dict_adapter(spec.model_args["debugmodel"], None).from_hf(hf)


def test_hsdp_resumes_bit_for_bit_exports_to_hugging_face_and_reshards(tmp_path, prepared_data):
    dump = tmp_path / "hsdp"
    hsdp = ("--parallelism.data_parallel_replicate_degree", "2",
            "--parallelism.data_parallel_shard_degree", "2")
    full, resumed = straight_and_resumed(
        dump, *hsdp, nproc=4,
        straight=("--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only"))
    full, resumed = step_losses(full), step_losses(resumed)
    assert sorted(full) == list(range(1, STEPS + 1)) and float(full[STEPS]) < float(full[1]) - 0.4, full
    assert resumed == {s: full[s] for s in range(SAVE + 1, STEPS + 1)}, (full, resumed)

    # The export holds the bf16 weights as they are, equal to the resumed run's at the
    # same step (bit for bit, as the losses are).
    exported = hf_export(dump / f"straight-step-{STEPS}")
    model = {k: v for k, v in dcp_tensors(dump / "checkpoint" / f"step-{STEPS}").items()
             if not k.startswith(("optimizer", "lr_scheduler", "dataloader", "train_state"))
             and "titan_lowbit" not in k}
    assert sorted(exported) == sorted(model), (sorted(exported), sorted(model))
    for key, value in exported.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, model[key]), key

    reshards_onto_fsdp(dump)


def test_pipeline_parallel_resumes_bit_for_bit_and_reshards(tmp_path, prepared_data):
    # Interleaved1F1B: 4 stages of the 6-layer model on 2 pipeline ranks, so each rank
    # steps two model parts (two optimizers) and precomputes the BitNet scales of both.
    dump = tmp_path / "pp"
    fp32_states = ("--lowbit.fp32_states", "tok_embeddings,output")
    full, _ = straight_and_resumed(dump, *fp32_states, *SMALL_STEPS, "--parallelism.pipeline_parallel_degree", "2",
                                   "--parallelism.data_parallel_shard_degree", "2",
                                   "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", nproc=4)
    # fp32_states checks its fragments against every stage's names: each rank's parts
    # hold one of the two selected parameters.
    assert "fp32 states for 1 param" in full, full[-3000:]

    # Rank 0 holds the first stages and logs no loss under PP: the checkpoints show that
    # both ends of the model trained, in the states asked for, and that the resumed run
    # ends where the straight one ended, every model and optimizer tensor equal.
    saved, last = dcp_tensors(dump / "checkpoint" / f"step-{SAVE}"), dcp_tensors(dump / f"straight-step-{STEPS}")
    assert last["optimizer.state.tok_embeddings.weight.exp_avg"].dtype == torch.float32
    assert "optimizer.state.layers.5.attention.wq.weight.exp_avg_codes" in last
    for first_and_last in ("tok_embeddings.weight", "output.weight", "layers.0.attention.wq.weight",
                           "layers.5.feed_forward.w2.weight"):
        assert not torch.equal(saved[first_and_last], last[first_and_last]), first_and_last
    resumed_ends_where_straight_ended(dump)

    reshards_onto_fsdp(dump, *fp32_states)


def test_early_step_in_backward_resumes_bit_for_bit(tmp_path, prepared_data):
    dump = tmp_path / "early"
    full, resumed = straight_and_resumed(dump, "--optimizer.early_step_in_backward", nproc=2)
    full, resumed = step_losses(full), step_losses(resumed)
    assert sorted(full) == list(range(1, STEPS + 1)) and float(full[STEPS]) < float(full[1]) - 0.4, full
    assert resumed == {s: full[s] for s in range(SAVE + 1, STEPS + 1)}, (full, resumed)
    resumed_ends_where_straight_ended(dump)


# Muon8bit with bf16 weights: Muon steps the 42 matrices of the debug model's 6 layers
# (the BitNet linears' latent weights where BitNet is on), its inner AdamW8bit the
# embeddings, the head and the norms. Its update's RMS is AdamW's settled one (0.2 lr), so
# it takes a larger lr (as in tests/test_train_e2e.py).
MUON8 = ("--optimizer.name", "Muon8bit", "--optimizer.lr", "1e-2", "--lowbit.weight_dtype", "bfloat16")
LAYER_MATRICES = 6 * 7  # wq, wk, wv, wo, w1, w2, w3 per layer


def muon_resumed_bit_for_bit(dump, full: str, resumed: str, *states: str) -> None:
    """The straight and resumed runs of a Muon name: equal losses after the resume and an
    equal last checkpoint; the loss falls (by how much depends on the corpus, the running
    Python's standard library: no threshold); every layer matrix has a quantized momentum
    and the ``states`` named (its weight update's, its factor's), and moved from step SAVE
    to step STEPS."""
    full, resumed = step_losses(full), step_losses(resumed)
    assert sorted(full) == list(range(1, STEPS + 1)) and float(full[STEPS]) < float(full[1]), full
    assert resumed == {s: full[s] for s in range(SAVE + 1, STEPS + 1)}, (full, resumed)
    last = resumed_ends_where_straight_ended(dump)
    saved = dcp_tensors(dump / "checkpoint" / f"step-{SAVE}")
    momentum = [k.removeprefix("optimizer.state.").removesuffix(".momentum_buffer_codes") for k in last
                if k.endswith(".momentum_buffer_codes")]
    assert len(momentum) == LAYER_MATRICES and all(k.startswith("layers.") for k in momentum), momentum
    for fqn in momentum:
        for state in states:
            assert f"optimizer.state.{fqn}.{state}" in last, (fqn, state)
        assert last[fqn].dtype == torch.bfloat16 and not torch.equal(saved[fqn], last[fqn]), fqn


def test_muon4bit_with_a_factor_on_hsdp_compiled_with_activation_checkpointing_resumes_bit_for_bit_and_reshards(
        tmp_path, prepared_data):
    # The model's blocks and the loss compiled (Inductor's C++ backend on the CPU path) and
    # recomputed in the backward; the optimizer step runs eagerly, as without compile.
    # Muon4bit keeps a rank-4 factor beside its codes: P sharded by rows, R replicated,
    # both in the checkpoint and resharded with it.
    dump = tmp_path / "muon_hsdp"
    features = ("--optimizer.name", "Muon4bit", "--optimizer.lr", "1e-2", "--lowbit.weight_dtype", "bfloat16",
                "--lowbit.weight_update", "stochastic", "--lowbit.muon_4bit_factor_rank", "4")
    full, resumed = straight_and_resumed(
        dump, "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
        "--compile.enable", "--activation_checkpoint.mode", "full", *SMALL_STEPS, nproc=4, features=features)
    assert ("Compiling each TransformerBlock with torch.compile" in full
            and "Applied full activation checkpointing" in full), full[-3000:]
    muon_resumed_bit_for_bit(dump, full, resumed, "momentum_buffer_row_factor", "momentum_buffer_col_factor")
    reshards_onto_fsdp(dump, features=features)


def test_muon_on_fsdp_x_tensor_parallel_with_bitnet_resumes_bit_for_bit_and_reshards(tmp_path, prepared_data):
    # BitNet's latent weights are Muon's matrices; their scales are precomputed after each
    # step over both mesh dimensions. TP 2 splits the 256-wide rows of wo and w2 in two:
    # blocks of 128 keep every quantization block of their momentum inside one shard.
    dump = tmp_path / "muon_fsdp_x_tp"
    features = (*MUON8, "--lowbit.weight_update", "master_remainder", "--lowbit.block_size", "128",
                "--model.converters", "bitnet")
    full, resumed = straight_and_resumed(
        dump, "--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
        *SMALL_STEPS, nproc=4, features=features)
    assert "converters ['bitnet']; optimizer Muon8bit" in full, full[-3000:]
    muon_resumed_bit_for_bit(dump, full, resumed, "master_remainder")
    reshards_onto_fsdp(dump, features=features)
