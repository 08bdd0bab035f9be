"""Optimizer-state bytes of a torchtitan 0.2 llama3 flavor, with and without
``[lowbit] fp32_states``, as the start-up line reports them (unsharded; no GPU needed:
the model and the states are built on the meta device by the same builder a run uses).

    python tools/state_bytes.py [--flavor 1B] [--name AdamW8bit] [--fp32-states tok_embeddings,output]
"""

import argparse

import torch
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.protocols.train_spec import get_train_spec

import titan_lowbit.torchtitan  # noqa: F401  (registers the 1B flavor and the optimizers)
from titan_lowbit.config import LowBit
from titan_lowbit.torchtitan.lowbit_optimizers import state_bytes_per_param
from titan_lowbit.torchtitan.optimizer_builder import build_lowbit_optimizers

GIB = 2 ** 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--name", default="AdamW8bit", help="[optimizer] name")
    parser.add_argument("--fp32-states", default="tok_embeddings,output",
                        help="[lowbit] fp32_states, comma-separated")
    args = parser.parse_args()
    spec = get_train_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(spec.model_args[args.flavor])
    numel = sum(p.numel() for p in model.parameters())
    print(f"llama3 {args.flavor}: {numel:,} parameters; [optimizer] name = {args.name}")
    rows = [("none", []), (args.fp32_states, [s for s in args.fp32_states.split(",") if s])]
    base = None
    for label, selection in rows:
        opts = build_lowbit_optimizers([model], OptimizerConfig(name=args.name), None,
                                       lowbit=LowBit(fp32_states=selection), seed=0,
                                       base_builder=build_optimizers)
        chosen = sum(p.numel() for o in opts for g in o.param_groups if g["state_format"] == "fp32"
                     and selection for p in g["params"])
        per_param = state_bytes_per_param(opts)
        total = per_param * numel
        base = base if base is not None else total
        print(f"fp32_states {label!r}: {chosen:,} parameters in fp32 states; {per_param:.3f} B/param, "
              f"{total / GIB:.3f} GiB of optimizer state (+{(total - base) / GIB:.3f} GiB)")


if __name__ == "__main__":
    main()
