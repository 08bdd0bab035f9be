"""A small model with llama3's parameter names and titan_lowbit's torchtitan 0.2
optimizer container around it, for the tests of per-parameter state formats and of state
conversion and of the Muon names (tests/test_fp32_states.py, tests/test_checkpoint_convert.py,
tests/test_muon_torchtitan.py)."""

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config import Optimizer as OptimizerConfig

from titan_lowbit.config import LowBit
from titan_lowbit.torchtitan.checkpoint_convert import FLATTENED
from titan_lowbit.torchtitan.optimizer_builder import build_lowbit_optimizers

VOCAB, DIM = 512, 64


class Tiny(nn.Module):
    """llama3's names: embeddings, a block with a norm and a linear, a final norm, the head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({"0": nn.ModuleDict({"attention_norm": nn.RMSNorm(DIM),
                                                         "wq": nn.Linear(DIM, DIM)})})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)


def build(model, name="AdamW8bit", **lowbit):
    return build_lowbit_optimizers([model], OptimizerConfig(name=name, lr=1e-2), None,
                                   lowbit=LowBit(**lowbit), seed=0, base_builder=build_optimizers)


def step(container, model, steps=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        container.step()


class Container:
    """What the checkpoint code reads of torchtitan's optimizer container."""

    def __init__(self, model, optimizers):
        self.model_parts, self.optimizers = [model], list(optimizers)

    def state_dict(self):
        return get_optimizer_state_dict(self.model_parts[0], self.optimizers[0], options=FLATTENED)
