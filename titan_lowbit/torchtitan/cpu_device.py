"""The CPU device path: run the real torchtitan Trainer on a machine with no GPU.

torchtitan (0.2 and 0.3 alike) picks its device once, at import, through
``torchtitan.tools.utils.get_device_info()``; with no accelerator it falls back to
``"cuda"`` and ``torch.cuda``, and the Trainer then fails at ``set_device``. This module
is the one place where titan_lowbit teaches torchtitan about the CPU:

- ``device_type = "cpu"``, so ``torch.device("cpu:<rank>")`` is used for the model and
  torch.distributed picks the ``gloo`` backend (gloo implements the all-gather and
  reduce-scatter that FSDP2 issues);
- ``device_module = CpuDeviceModule``: the handful of ``torch.cuda``-style calls the
  Trainer and its memory monitor make (``set_device``, ``memory_stats``, ...), answered
  for the process (peak resident memory stands in for the allocator's peak);
- DTensor's random fills on a CPU mesh (:func:`fill_whole_then_shard`): torch keeps
  DTensor's sharded random streams for GPU meshes only, and on a CPU mesh every rank
  would fill its shard with the same values, so the model torchtitan initialises after
  sharding it (FSDP2, TP) would hold copies of one shard; each rank instead fills the
  whole tensor and keeps its shard, the values one process draws.

:func:`switch` (run by ``titan_lowbit.torchtitan``, the ``custom_import`` target) turns it
on, with one log line, when the machine has no GPU, or when ``TITAN_LOWBIT_DEVICE=cpu``
asks for it. A machine that has NVIDIA GPUs on which CUDA does not initialise (a broken
driver, a CPU-only torch build) gets an error instead of a run on its CPU.
Nothing here changes any math: the model, the optimizer and FSDP2 run as they would on
a GPU, with the pure-PyTorch reference kernels.
"""

from __future__ import annotations

import glob
import os
import platform
import resource
import shutil
import sys
import warnings
from types import SimpleNamespace

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_lowbit.log_notes import drop_notes

_ENV = "TITAN_LOWBIT_DEVICE"


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class CpuDeviceModule:
    """The subset of the ``torch.cuda`` module interface that torchtitan calls.

    Memory figures are per process: "reserved" and "active" peaks are both the peak
    resident set size, which is what a user of a CPU run can act on.
    """

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device) -> None:  # one address space: nothing to select
        return None

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def get_device_name(device=None) -> str:
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"

    @staticmethod
    def get_device_properties(device=None):
        return SimpleNamespace(total_memory=_total_memory_bytes(), name="cpu")

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None  # the OS keeps the process peak; it cannot be reset

    @staticmethod
    def empty_cache() -> None:
        return None


def _env_choice() -> str:
    choice = os.environ.get(_ENV, "").lower()
    if choice not in ("", "cpu", "auto", "cuda"):
        raise ValueError(f"{_ENV}={choice!r}: use 'cpu', 'cuda' or 'auto' (the default)")
    return choice


def gpu_signs() -> list[str]:
    """What says this machine has NVIDIA GPUs, whatever torch thinks: device files, the
    driver's ``nvidia-smi``, a ``CUDA_VISIBLE_DEVICES`` naming devices."""
    signs = sorted(glob.glob("/dev/nvidia[0-9]*"))[:1]
    if shutil.which("nvidia-smi"):
        signs.append("nvidia-smi on PATH")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible not in (None, "", "-1"):
        signs.append(f"CUDA_VISIBLE_DEVICES={visible}")
    return signs


def _cuda_failure() -> str:
    """Why CUDA does not initialise, in torch's words."""
    if torch.version.cuda is None and torch.version.hip is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    try:
        torch.cuda.init()
    except Exception as error:  # torch names the cause (driver, device files, ...)
        return f"torch.cuda.init() raised {type(error).__name__}: {error}"
    return "torch.cuda.is_available() is False"


def cpu_reason() -> str | None:
    """Why this process should run torchtitan on the CPU, or None for the GPU path.

    Raises when the machine shows NVIDIA GPUs but CUDA does not initialise: a GPU node
    whose driver failed must not train on its CPU without a word."""
    choice = _env_choice()
    if choice == "cpu":
        return f"{_ENV}=cpu"
    if choice == "cuda" or torch.cuda.is_available():
        return None
    if signs := gpu_signs():
        raise RuntimeError(
            f"titan_lowbit: this machine has NVIDIA GPUs ({', '.join(signs)}) but CUDA does "
            f"not initialise: {_cuda_failure()}. Fix the driver or the torch install "
            "(`nvidia-smi` lists the GPUs, and `python -c \"import torch; "
            "print(torch.cuda.is_available())\"` prints True), or set "
            f"{_ENV}=cpu to train on the CPU on purpose."
        )
    return "no GPU found: torch.cuda.is_available() is False"


# torchtitan's start-up warnings that are wrong on the CPU path, by a fragment of each: the
# GPU model behind the peak FLOPS (no GPU to look up), the MFU reference (an A100's peak
# stands in for the CPU's), NCCL's environment variables set on a gloo run.
CPU_PATH_NOISE = (
    "Error running lspci",
    "Peak flops undefined for",
    "fallback to A100",
    "TORCH_NCCL_",
)
# torch's warnings that are wrong on the CPU path: DTensor's random ops on a CPU mesh "may
# not have complete support" (the CPU path fills sharded tensors whole on every rank,
# fill_whole_then_shard: they hold the values one process draws); "Set timeout is now only
# supported for either nccl or gloo", from torchtitan's timeout adjustment after the first
# step, on a gloo run (the timeout torchtitan sets at start-up stays in force).
CPU_PATH_WARNINGS = (r"DTensor (random operators|manual_seed\(\)) may not have complete support on cpu device mesh"
                     r"|Set timeout is now only supported for either nccl or gloo")


def quiet() -> None:
    """Silence, on the CPU path only, the warnings that are wrong there."""
    drop_notes(*CPU_PATH_NOISE)
    warnings.filterwarnings("ignore", message=CPU_PATH_WARNINGS, category=UserWarning)


def switch() -> bool:
    """Move torchtitan to the CPU path when :func:`cpu_reason` says so, saying it in one
    log line and silencing the warnings that are wrong there (:func:`quiet`); True when
    it did."""
    reason = cpu_reason()
    if reason is None:
        return False
    enable()
    quiet()
    from torchtitan.tools.logging import logger

    logger.warning(
        f"titan_lowbit: torchtitan runs on the CPU path ({reason}): gloo process group, "
        f"pure-PyTorch reference kernels. Set {_ENV}=cuda to insist on GPUs."
    )
    return True


# Where each torchtitan line keeps a copy of its device globals: torchtitan modules import
# ``device_type``/``device_module`` by name, so every module holding a copy is updated
# (writes into torchtitan, listed in kernels/private_apis.py).
DEVICE_GLOBALS = {
    (0, 2): {
        "torchtitan.tools.utils": ("device_type", "device_module"),
        "torchtitan.distributed.utils": ("device_type", "device_module"),
        "torchtitan.components.metrics": ("device_type", "device_module"),
        "torchtitan.distributed.parallel_dims": ("device_type",),
        "torchtitan.tools.profiling": ("device_module",),
    },
    (0, 3): {
        "torchtitan.tools.utils": ("device_type", "device_module"),
        "torchtitan.distributed.utils": ("device_type", "device_module"),
        "torchtitan.components.metrics": ("device_type", "device_module"),
        "torchtitan.distributed.parallel_dims": ("device_type",),
        "torchtitan.tools.profiler": ("device_module",),
        "torchtitan.models.common.token_dispatcher": ("device_type", "device_module"),
    },
}


# DTensor's in-place random fills: what initialisation calls (torch.nn.init's normal_,
# uniform_, trunc_normal_, kaiming_*, xavier_* reach DTensor as these).
RANDOM_FILLS = (torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default,
                torch.ops.aten.bernoulli_.float)


def fill_whole_then_shard(op, args, kwargs) -> DTensor:
    """A random fill of a DTensor on a CPU mesh, as one process would draw it: every rank
    fills a tensor of the whole shape from its generator, in step with the others (the
    Trainer seeds every rank alike), and copies its own shard of it into its local tensor.

    Torch's DTensor gives each shard its own part of one random stream through the
    generator's offset (Philox), which only GPU generators have; on a CPU mesh it runs the
    fill on each local tensor, so every shard would get the same values: FSDP2 shards that
    repeat, and TP shards of attention heads and feed-forward units that also get the same
    gradients and stay copies, a model as wide as one TP shard. The cost: every rank draws
    every parameter whole, once, at initialisation.
    """
    target = args[0]
    local = target.to_local()
    whole = torch.empty(target.shape, dtype=target.dtype, device=local.device)
    op(whole, *args[1:], **kwargs)
    shard = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
    local.copy_(shard.to_local())
    return target


def use_whole_random_fills() -> None:
    """Route DTensor's random fills (``RANDOM_FILLS``) through :func:`fill_whole_then_shard`
    (an entry of DTensor's table of op handlers, listed in kernels/private_apis.py)."""
    from titan_lowbit.kernels.private_apis import patch_entry

    for op in RANDOM_FILLS:
        patch_entry(DTensor, "_op_dispatcher._custom_op_handlers", op, fill_whole_then_shard)


def enable() -> None:
    """Point torchtitan's device globals at the CPU, everywhere they were copied, and
    DTensor's random fills at :func:`fill_whole_then_shard`.

    The list of holders is checked, so a torchtitan release that moves them fails loudly
    instead of half-switching.
    """
    import importlib

    from titan_lowbit.compat import torchtitan_line
    from titan_lowbit.kernels.private_apis import patch

    use_whole_random_fills()

    line = torchtitan_line()
    holders = DEVICE_GLOBALS.get(line)
    if holders is None:
        raise RuntimeError(f"titan_lowbit's CPU path knows torchtitan lines {sorted(DEVICE_GLOBALS)}, "
                           f"not {line}")
    values = {"device_type": "cpu", "device_module": CpuDeviceModule}
    for module_name, names in holders.items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):
                raise RuntimeError(
                    f"titan_lowbit's CPU path expects {module_name}.{name}; this torchtitan "
                    f"version is not supported (tested: {', '.join(map(str, sorted(DEVICE_GLOBALS)))})"
                )
            patch(module, name, values[name])


def is_enabled() -> bool:
    import torchtitan.tools.utils as tt_utils

    return tt_utils.device_type == "cpu"


def use_gloo_reductions(model: torch.nn.Module) -> int:
    """Make FSDP2 reduce gradients with ReduceOp.SUM and divide afterwards.

    torchtitan sets a gradient divide factor (the global token count) on every FSDP2
    module; FSDP2 then reduce-scatters with NCCL's ``PREMUL_SUM``, which gloo lacks.
    SUM followed by the same division is the same math. Returns the number of FSDP2
    modules changed.
    """
    from torch.distributed.fsdp import FSDPModule

    changed = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            changed += 1
    return changed
