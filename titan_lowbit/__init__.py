"""titan_lowbit: low-bit AdamW, full-BF16 weights and BitNet b1.58, for torchtitan and
for any PyTorch training loop.

Importing the package does nothing beyond defining it: no torchtitan import, no
registration, no change of device. The parts are imported by name:

- ``titan_lowbit.optim`` (``LowBitAdamW``) and ``titan_lowbit.bitnet``
  (``convert_to_bitnet``) need torch and triton only, and work in any loop, under plain
  FSDP2 (``fully_shard``) and with DCP checkpoints;
- ``titan_lowbit.torchtitan`` is the torchtitan integration, imported by torchtitan's
  Trainer when a job file says ``[experimental] custom_import = "titan_lowbit.torchtitan"``;
- ``titan_lowbit.config`` adds the ``[lowbit]`` section
  (``[job] custom_config_module = "titan_lowbit.config"``).
"""
