"""Model converters: register titan_lowbit's, and make an unknown name a clear error.

torchtitan looks converters up as ``_registry_model_converter_cls[name]``, so a typo in
``[model] converters`` surfaces as a bare ``KeyError: 'bitnt'``. The registry dict is
replaced by one that names the key and the valid choices (same contents, same lookups).
"""

from __future__ import annotations

import torchtitan.protocols.model_converter as model_converter


class ConverterRegistry(dict):
    """torchtitan's converter registry, with a helpful error for unknown names."""

    def __missing__(self, name):
        raise ValueError(
            f"[model] converters names unknown converter {name!r}; registered converters "
            f"are {sorted(self)}. Check the spelling, and that [experimental] "
            'custom_import = "titan_lowbit.torchtitan" is set for titan_lowbit\'s converters.'
        )


def register() -> None:
    from titan_lowbit.bitnet import CONVERTERS

    registry = model_converter._registry_model_converter_cls
    if not isinstance(registry, ConverterRegistry):
        registry = ConverterRegistry(registry)
        model_converter._registry_model_converter_cls = registry
    for name, cls in CONVERTERS.items():
        if registry.get(name) is not cls:
            model_converter.register_model_converter(cls, name)
