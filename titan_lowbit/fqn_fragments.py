"""How a ``[lowbit]`` list of name fragments selects modules or parameters.

A fragment selects every fully qualified name (FQN) that contains it as a substring, as
torchtitan's own ``filter_fqns`` keys do: ``"output"`` selects ``output`` and
``output.weight``, ``"norm"`` every norm (``norm.weight``,
``layers.0.attention_norm.weight``, ...), ``"tok_embeddings"`` the embedding table.
Substrings keep working where wrappers add levels to the names (activation checkpointing's
``_checkpoint_wrapped_module``, compile's ``_orig_mod``). ``bitnet_filter`` (modules) and
``fp32_states`` (parameters) both select this way; a fragment that selects nothing is an
error, never an empty selection.

This module imports nothing from titan_lowbit, so every layer may use it.
"""

from __future__ import annotations

from typing import Iterable


def selects(fqn: str, fragments: Iterable[str]) -> bool:
    """Whether any of ``fragments`` selects ``fqn``."""
    return any(fragment in fqn for fragment in fragments)


def check_every_fragment_selects(key: str, fragments: Iterable[str], fqns: list[str], what: str) -> None:
    """Raise ValueError naming ``[lowbit] key``'s fragments that select none of ``fqns``
    (the names of ``what``, e.g. "module of Transformer"), with a few names to pick from."""
    unmatched = [f for f in fragments if not any(f in n for n in fqns)]
    if unmatched:
        shown = ", ".join(repr(f) for f in unmatched)
        raise ValueError(
            f"[lowbit] {key} entr{'ies' if len(unmatched) > 1 else 'y'} {shown} "
            f"match{'' if len(unmatched) > 1 else 'es'} no {what} (a fragment selects every "
            f"name that contains it; names look like {fqns[:6]}); fix the fragment or remove it."
        )
