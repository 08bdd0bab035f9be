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
- ``llama3_debug_bitnet_subln``: the same with SubLN (an RMSNorm on the input of every
  linear of a block, the block norms removed), as BitNet's own architecture has.
- ``llama3_1b``: llama3 with TinyLlama-1.1B's shapes (the 0.2 line's ``1B`` flavor,
  ``flavors.LLAMA3_1B``), bf16 weights with 8-bit states and ``master_remainder``,
  compiled, 2,000 steps of 4 x 2048 tokens per GPU, validation every 250 steps: a GPU config.
- ``llama3_1b_bitnet``: the same with BitNet b1.58 linears in the transformer layers.
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn
from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.config.override import derive
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
from torchtitan.models.common.param_init import depth_scaled_std
from torchtitan.models.llama3 import Llama3Model, model_registry, parallelize_llama
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from titan_lowbit.torchtitan import datasets, flavors
from titan_lowbit.torchtitan.v03 import (
    BitNetConverter,
    BitNetSubLNConverter,
    HealthMetricsProcessor,
    LowBitOptimizersContainer,
    LowBitTrainer,
)

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
    config.metrics = HealthMetricsProcessor.Config(log_freq=1)
    config.debug.seed = 0
    config.validator.enable = False
    config.checkpoint.interval = 10
    return config


def llama3_debug_bitnet() -> LowBitTrainer.Config:
    config = llama3_debug()
    config.model_spec = model_registry("debugmodel", converters=[BitNetConverter.Config()])
    return config


def llama3_debug_bitnet_subln() -> LowBitTrainer.Config:
    config = llama3_debug()
    config.model_spec = model_registry("debugmodel", converters=[
        BitNetSubLNConverter.Config(), BitNetConverter.Config()])
    return config


def llama3_1b_spec(converters=(), attn_backend: str = "flex") -> ModelSpec:
    """llama3 with TinyLlama-1.1B's shapes (``flavors.LLAMA3_1B``), built like torchtitan's
    own llama3 flavors: truncated-normal linears (std 0.02, depth-scaled for the output
    projections), fused QKV, untied embeddings; ``converters`` (e.g. BitNet) applied."""
    shapes = flavors.LLAMA3_1B
    dim, heads, vocab = shapes["dim"], shapes["n_heads"], shapes["vocab_size"]
    linear = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm = {"weight": nn.init.ones_}

    def depth(layer: int) -> dict:
        return {"weight": partial(nn.init.trunc_normal_, std=depth_scaled_std(0.02, layer)),
                "bias": nn.init.zeros_}

    std_out = dim ** -0.5
    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm),
        ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm),
        attention=make_gqa_config(
            dim=dim, n_heads=heads, n_kv_heads=shapes["n_kv_heads"], wqkv_param_init=linear,
            wo_param_init=depth(i), inner_attention=get_attention_config(attn_backend), fuse_qkv=True,
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=2048, theta=shapes["rope_theta"])),
        feed_forward=make_ffn_config(
            dim=dim, hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=shapes["multiple_of"]),
            w1_param_init=linear, w2w3_param_init=depth(i)),
    ) for i in range(shapes["n_layers"])]
    model = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init={
            "weight": partial(nn.init.trunc_normal_, std=std_out, a=-3 * std_out, b=3 * std_out)}),
        layers=layers,
    )
    for converter in converters:
        model = converter.build().convert(model)
    return ModelSpec(name="llama3", flavor="1B", model=model, parallelize_fn=parallelize_llama,
                     pipelining_fn=pipeline_llm, post_optimizer_build_fn=None,
                     state_dict_adapter=Llama3StateDictAdapter)


def llama3_1b() -> LowBitTrainer.Config:
    datasets.register()
    config = on_corpus(llama3_debugmodel())
    config.model_spec = llama3_1b_spec()
    config.loss.loss_fn.global_vocab_size = flavors.LLAMA3_1B["vocab_size"]
    config.optimizer = lowbit_optimizer(lr=4e-4)
    config.lr_scheduler.warmup_steps = 100
    config.lr_scheduler.decay_ratio = 0.8
    config.lr_scheduler.decay_type = "cosine"
    config.lr_scheduler.min_lr_factor = 0.1
    config.training.dtype = "bfloat16"
    config.training.local_batch_size = 4
    config.training.seq_len = 2048
    config.training.steps = 2000
    config.metrics = HealthMetricsProcessor.Config(log_freq=10)
    config.compile.enable = True
    config.compile.components = ["model", "loss"]
    config.validator.enable = True
    config.validator.freq = 250
    config.validator.steps = 20
    config.checkpoint.interval = 500
    config.debug.seed = 0
    return config


def llama3_1b_bitnet() -> LowBitTrainer.Config:
    config = llama3_1b()
    config.model_spec = llama3_1b_spec(converters=[BitNetConverter.Config()])
    return config
