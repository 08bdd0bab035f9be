"""Run under torchrun by tests/test_reshard.py: build the torchtitan Trainer from the
given config and overrides, load a DCP checkpoint (written by another number of
processes), and check that every model and optimizer tensor, gathered to full size,
equals the checkpoint's element for element. Prints "RESHARD OK <n> tensors" on rank 0.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import titan_lowbit.torchtitan  # noqa: F401  (what custom_import does inside the Trainer)
from torchtitan.config import ConfigManager
from torchtitan.train import Trainer
from whole_tensors import whole  # tests/whole_tensors.py, beside this script


def main(checkpoint_dir: str, step: int, argv: list[str]) -> None:
    config = ConfigManager().parse_args(argv)
    trainer = Trainer(config)
    assert trainer.checkpointer.load(step=step), f"no checkpoint at step {step}"
    live = {"model": trainer.checkpointer.states["model"].state_dict(),
            "optimizer": trainer.optimizers.state_dict()}
    # Gather on every rank (collectives), compare on rank 0 against the checkpoint.
    gathered = {part: {k: whole(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
                for part, sd in live.items()}
    if dist.get_rank() == 0:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ckpt.pt")
            dcp_to_torch_save(os.path.join(checkpoint_dir, f"step-{step}"), path)
            saved = torch.load(path, weights_only=False)
        checked = 0
        for part, tensors in gathered.items():
            for key, value in tensors.items():
                # torchtitan stores model tensors at the top level, the rest per part.
                ref = saved[key] if part == "model" else saved[part][key]
                assert value.dtype == ref.dtype and value.shape == ref.shape, (
                    f"{part}.{key}: {value.dtype}{tuple(value.shape)} vs saved "
                    f"{ref.dtype}{tuple(ref.shape)}")
                assert torch.equal(value.cpu(), ref), f"{part}.{key} differs from the checkpoint"
                checked += 1
        assert any(".exp_avg" in k for k in gathered["optimizer"]), "no optimizer state checked"
        print(f"RESHARD OK {checked} tensors on {dist.get_world_size()} processes", flush=True)
    dist.barrier()
    trainer.close()
    # As torchtitan's own entry point does: a process group left to the interpreter's
    # exit can abort the process there.
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
