"""Model converters: register titan_lowbit's, and make an unknown name a clear error.

torchtitan looks converters up as ``_registry_model_converter_cls[name]``, so a typo in
``[model] converters`` surfaces as a bare ``KeyError: 'bitnt'``. The registry dict is
replaced by one that names the key and the valid choices (same contents, same lookups);
the dict is torchtitan's private name, so only with a tested torchtitan
(kernels/private_apis.py).
"""

from __future__ import annotations

import torchtitan.protocols.model_converter as model_converter

from titan_lowbit.kernels.private_apis import patch, private_api_ok


class ConverterRegistry(dict):
    """torchtitan's converter registry, with a helpful error for unknown names."""

    def __missing__(self, name):
        raise ValueError(
            f"[model] converters names unknown converter {name!r}; registered converters "
            f"are {sorted(self)}. Check the spelling, and that [experimental] "
            'custom_import = "titan_lowbit.torchtitan" is set for titan_lowbit\'s converters.'
        )


_registered = False


def register() -> None:
    from titan_lowbit.bitnet import CONVERTERS

    if private_api_ok("torchtitan"):
        registry = model_converter._registry_model_converter_cls
        if not isinstance(registry, ConverterRegistry):
            patch(model_converter, "_registry_model_converter_cls", ConverterRegistry(registry))
    global _registered
    if not _registered:  # torchtitan refuses a name registered twice
        for name, cls in CONVERTERS.items():
            model_converter.register_model_converter(cls, name)
        _registered = True
