"""The torchtitan integration, for both torchtitan lines.

torchtitan 0.2.x (TOML configs): ``[experimental] custom_import = "titan_lowbit.torchtitan"``
imports this package inside torchtitan's Trainer, before the device, model and optimizer
are built. Importing it there:

- switches torchtitan to the CPU device path when there is no GPU, or when
  ``TITAN_LOWBIT_DEVICE=cpu`` asks for it, with one log line (cpu_device);
- registers the model converters ("bitnet", ...) with clear errors for unknown names;
- wraps every train spec so ``[optimizer] name`` reaches titan_lowbit's optimizers and
  ``[lowbit]`` reaches the builders (train_spec, optimizer_builder);
- adds the ``1B`` llama3 flavor and the offline ``lowbit_text`` datasets;
- checks, before a checkpoint is loaded, that it was written with this run's optimizer
  layout and parameter dtypes (checkpoint).

``[job] custom_config_module = "titan_lowbit.config"`` adds the ``[lowbit]`` section.

torchtitan 0.3 (Python configs): importing this package does nothing; the integration is
:mod:`titan_lowbit.torchtitan.v03` (the trainer, optimizer container, BitNet linear and
overrides) and :mod:`titan_lowbit.torchtitan.config_registry` (ready configs:
``--module titan_lowbit.torchtitan --config llama3_debug``).

Modules by line: ``v03`` and ``config_registry`` are the 0.3 line's; ``train_spec``,
``optimizer_builder``, ``converters``, ``datasets``, ``flavors`` and ``checkpoint`` are the
0.2 line's; ``cpu_device``, ``lowbit_optimizers`` and ``health_metrics`` serve both.
Nothing else in the package imports torchtitan: ``titan_lowbit.optim`` and
``titan_lowbit.bitnet`` serve any PyTorch loop without this package.
"""

from titan_lowbit.compat import TORCHTITAN_LINES, installed, torchtitan_line

_line = torchtitan_line()
if _line == (0, 2):
    from titan_lowbit import config as _config  # noqa: F401  (error messages for [lowbit])
    from titan_lowbit.torchtitan import checkpoint, converters, cpu_device, datasets, flavors, train_spec

    cpu_device.switch()
    converters.register()
    train_spec.register()
    flavors.register()
    datasets.register()
    checkpoint.register()
elif _line not in TORCHTITAN_LINES:
    raise ImportError(
        f"titan_lowbit.torchtitan: torchtitan {'.'.join(map(str, installed('torchtitan') or ())) or 'is not installed'}"
        f"{'' if _line is None else ' is not a supported line'}; titan_lowbit integrates with torchtitan "
        f"{' and '.join('.'.join(map(str, line)) for line in TORCHTITAN_LINES)} (pip install 'torchtitan>=0.2.2,<0.4')"
    )
