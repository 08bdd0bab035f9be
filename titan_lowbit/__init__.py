"""titan_lowbit: low-bit AdamW, full-BF16 weights and BitNet b1.58 for torchtitan.

``[experimental] custom_import = "titan_lowbit"`` imports this package inside
torchtitan's Trainer, before the device, model and optimizer are built. Importing it:

- switches torchtitan to the CPU device path when there is no GPU (cpu_device);
- registers the model converters ("bitnet", ...) with clear errors for unknown names;
- wraps every train spec so ``[optimizer] name`` reaches titan_lowbit's optimizers and
  ``[lowbit]`` reaches the builders (train_spec, optimizer_builder);
- adds the ``1B`` llama3 flavor and the offline ``lowbit_text`` datasets;
- checks, before a checkpoint is loaded, that it was written with this run's optimizer
  layout and parameter dtypes (checkpoint).

``[job] custom_config_module = "titan_lowbit.config"`` adds the ``[lowbit]`` section.
"""

from titan_lowbit import config as _config  # noqa: F401  (error messages for [lowbit])
from titan_lowbit import checkpoint, converters, cpu_device, datasets, flavors, train_spec

if cpu_device.wanted():
    cpu_device.enable()
converters.register()
train_spec.register()
flavors.register()
datasets.register()
checkpoint.register()
