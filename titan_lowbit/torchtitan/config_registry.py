"""Ready configs for torchtitan 0.3: ``--module titan_lowbit.torchtitan --config NAME``.

Each function returns a :class:`~titan_lowbit.torchtitan.v03.LowBitTrainer` config built
on torchtitan's own llama3 config of the same size, training on the offline corpus
(``python -m titan_lowbit.prepare_data``) with its tokenizer. Every value can be changed
on the command line as usual (``--training.steps 50``, ``--debug.seed 1``, ...), the
optimizer with the ``lowbit_adamw`` override, e.g.
``--override.imports 'titan_lowbit.torchtitan.v03.lowbit_adamw={"name": "AdamW4bit",
"weight_update": "stochastic"}'``.

- ``llama3_debug``: the debug model (dim 256, 6 layers), full-BF16 weights, 8-bit AdamW
  states with exact fp32 master weights kept as a bf16 remainder
  (``weight_update = "master_remainder"``) for the matrices, torch's AdamW for norms
  and embeddings; 20 steps of 4 x 256 tokens: minutes on 2 CPU processes.
- ``llama3_debug_bitnet``: the same with BitNet b1.58 linears in the transformer layers.
- ``llama3_1b``: torchtitan's llama3 1B flavor, the same optimizer split, bf16 mixed
  precision.
"""

from __future__ import annotations

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.config.override import derive
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from titan_lowbit.torchtitan import datasets
from titan_lowbit.torchtitan.v03 import BitNetConverter, LowBitOptimizersContainer, LowBitTrainer

# Norms, biases and embeddings: torch's AdamW (few elements, or rows read sparsely);
# everything else: titan_lowbit's. First match wins.
SMALL_PARAMS = r"(norm|bias|tok_embeddings)"


def lowbit_optimizer(lr: float, name: str = "AdamW8bit", weight_update: str = "master_remainder",
                     weight_decay: float = 0.1) -> LowBitOptimizersContainer.Config:
    """``name`` for the matrices, torch's AdamW for norms, biases and embeddings (with the
    same bf16 update rule, which makes it LowBitAdamW with fp32 states where the weights
    are bf16)."""
    common = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": weight_decay,
              "weight_update": weight_update}
    return LowBitOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=SMALL_PARAMS, optimizer_name="AdamW",
                         optimizer_kwargs={**common, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs=common),
    ])


def on_corpus(config: Trainer.Config) -> LowBitTrainer.Config:
    """``config`` as a LowBitTrainer config that trains and validates on the offline
    corpus with its tokenizer (``$TITAN_LOWBIT_DATA``, else the default data folder)."""
    folder = str(datasets.data_dir())
    config = derive(config, LowBitTrainer.Config)
    config.hf_assets_path = datasets.corpus_tokenizer(folder)
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="lowbit_text")
    config.validator.dataloader = HuggingFaceTextDataLoader.Config(dataset="lowbit_text_validation")
    return config


def llama3_debug() -> LowBitTrainer.Config:
    datasets.register()
    config = on_corpus(llama3_debugmodel())
    config.optimizer = lowbit_optimizer(lr=3e-3)
    config.lr_scheduler.warmup_steps = 2
    config.training.dtype = "bfloat16"
    config.training.local_batch_size = 4
    config.training.seq_len = 256
    config.training.steps = 20
    config.metrics = MetricsProcessor.Config(log_freq=1)
    config.debug.seed = 0
    config.validator.enable = False
    config.checkpoint.interval = 10
    # torchtitan's DTensor path for the data-parallel and model-parallel axes, the one that
    # runs on CPU processes too (its spmd_types backend stops in FSDP2 on CPU meshes)
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def llama3_debug_bitnet() -> LowBitTrainer.Config:
    config = llama3_debug()
    config.model_spec = model_registry("debugmodel", converters=[BitNetConverter.Config()])
    return config


def llama3_1b() -> LowBitTrainer.Config:
    from torchtitan.models.llama3.config_registry import llama3_8b

    datasets.register()
    config = on_corpus(llama3_8b())
    config.model_spec = model_registry("1B")
    config.optimizer = lowbit_optimizer(lr=3e-4)
    config.training.dtype = "bfloat16"
    config.debug.seed = 0
    config.parallelism.spmd_backend = "partial_dtensor"
    return config
