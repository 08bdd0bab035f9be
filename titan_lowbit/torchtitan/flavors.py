"""Model flavors titan_lowbit adds beside torchtitan's own.

``1B`` has TinyLlama-1.1B's shapes (dim 2048, 22 layers, 32 heads, 4 KV heads,
ffn 5632, vocab 32000): big enough that optimizer and linear-layer speed show in
tokens/s on one GPU, small enough to train there with fp32 AdamW as the baseline.
"""

from __future__ import annotations

from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import TransformerModelArgs

LLAMA3_FLAVORS: dict[str, TransformerModelArgs] = {
    # ffn: llama3 sizes the MLP as multiple_of * ceil(8/3 * dim / multiple_of);
    # with dim 2048 and multiple_of 256 that is 22 * 256 = 5632, TinyLlama's width.
    "1B": TransformerModelArgs(
        dim=2048,
        n_layers=22,
        n_heads=32,
        n_kv_heads=4,
        vocab_size=32000,
        multiple_of=256,
        rope_theta=10000,
    ),
}


def register() -> None:
    for name, args in LLAMA3_FLAVORS.items():
        existing = llama3_args.get(name)
        if existing is not None and existing is not args:
            raise RuntimeError(
                f"llama3 flavor {name!r} is already defined by torchtitan; titan_lowbit "
                "would shadow it. Rename titan_lowbit's flavor."
            )
        llama3_args[name] = args
