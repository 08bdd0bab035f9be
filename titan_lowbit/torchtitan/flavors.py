"""Model flavors titan_lowbit adds beside torchtitan's own.

``1B`` has TinyLlama-1.1B's shapes (dim 2048, 22 layers, 32 heads, 4 KV heads,
ffn 5632, vocab 32000): big enough that optimizer and linear-layer speed show in
tokens/s on one GPU, small enough to train there with fp32 AdamW as the baseline.

The shapes are written once, here: the 0.2 line registers them as llama3 flavor ``1B``
(:func:`register`), the 0.3 line builds its ``llama3_1b`` config from them
(``config_registry``).
"""

from __future__ import annotations

# ffn: llama3 sizes the MLP as multiple_of * ceil(8/3 * dim / multiple_of); with dim 2048
# and multiple_of 256 that is 22 * 256 = 5632, TinyLlama's width.
LLAMA3_1B = dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000,
                 multiple_of=256, rope_theta=10000)


_registered: dict[str, object] = {}  # what register() put into torchtitan's table


def register() -> None:
    """torchtitan 0.2: add the flavors to torchtitan's llama3 flavor table."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    from titan_lowbit.kernels.private_apis import patch_entry

    for name, shapes in {"1B": LLAMA3_1B}.items():
        existing = llama3.llama3_args.get(name)
        if existing is not None and existing is not _registered.get(name):
            raise RuntimeError(
                f"llama3 flavor {name!r} is already defined by torchtitan; titan_lowbit "
                "would shadow it. Rename titan_lowbit's flavor."
            )
        if existing is None:
            _registered[name] = TransformerModelArgs(**shapes)
            patch_entry(llama3, "llama3_args", name, _registered[name])
