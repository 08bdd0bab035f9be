"""The torchtitan integration: the target of ``custom_import``.

``[experimental] custom_import = "titan_lowbit.torchtitan"`` imports this module inside
torchtitan's Trainer, before the device, model and optimizer are built. Importing it:

- switches torchtitan to the CPU device path when there is no GPU, or when
  ``TITAN_LOWBIT_DEVICE=cpu`` asks for it, with one log line (cpu_device);
- registers the model converters ("bitnet", ...) with clear errors for unknown names;
- wraps every train spec so ``[optimizer] name`` reaches titan_lowbit's optimizers and
  ``[lowbit]`` reaches the builders (train_spec, optimizer_builder);
- adds the ``1B`` llama3 flavor and the offline ``lowbit_text`` datasets;
- checks, before a checkpoint is loaded, that it was written with this run's optimizer
  layout and parameter dtypes (checkpoint).

``[job] custom_config_module = "titan_lowbit.config"`` adds the ``[lowbit]`` section.
Nothing else in the package imports torchtitan: ``titan_lowbit.optim`` and
``titan_lowbit.bitnet`` serve any PyTorch loop without this module.
"""

from titan_lowbit import config as _config  # noqa: F401  (error messages for [lowbit])
from titan_lowbit import checkpoint, converters, cpu_device, datasets, flavors, train_spec

cpu_device.switch()
converters.register()
train_spec.register()
flavors.register()
datasets.register()
checkpoint.register()
