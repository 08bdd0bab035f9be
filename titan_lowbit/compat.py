"""The private APIs of torch, Triton, Inductor and torchtitan that titan_lowbit uses, what
each buys, and the versions it was tested with.

A private name can change in any release. The uses whose gain is speed or a safety check
around torchtitan ask :func:`private_api_ok` first; it says no when the installed version
of that library is outside ``TESTED`` (or when ``TITAN_LOWBIT_PRIVATE_APIS=0`` asks for
the public paths, e.g. to rule the hooks out while debugging). Then the public path is
taken, same results, and one log line per library names the version and the tested range.
The remaining uses (``STRUCTURAL``) are how torch tensor subclasses and DTensor code are
written, and the one hook torchtitan 0.3 gives an optimizer name; they have no public
equivalent and are covered by the torch and torchtitan ranges that pyproject.toml declares.

This module imports nothing from titan_lowbit, so every layer (kernels included) may use it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from dataclasses import dataclass
from importlib import metadata

logger = logging.getLogger(__name__)

# Versions run here: torch 2.13 + triton 3.9 (CI, CPU, kernels under Triton's interpreter
# and compiled for sm_90 without a GPU), torch 2.11 + triton 3.6 (the H100 hosts), both
# with torchtitan 0.2.2; torch 2.14 + triton 3.8 with torchtitan 0.3.0 (CI's CPU processes
# only: 0.3 needs torch 2.14, newer than the H100 hosts carry). Inclusive, compared on
# (major, minor) for torch and Triton.
TESTED = {
    "torch": ((2, 11), (2, 14)),
    "triton": ((3, 6), (3, 9)),
    "torchtitan": ((0, 2, 2), (0, 3, 0)),
}
# The torchtitan lines titan_lowbit integrates with, each by its own module of
# titan_lowbit.torchtitan: 0.2 (TOML configs, custom_import) and 0.3 (Python configs,
# --override.imports). The private uses below belong to one line each.
TORCHTITAN_LINES = ((0, 2), (0, 3))
ENV = "TITAN_LOWBIT_PRIVATE_APIS"


@dataclass(frozen=True)
class PrivateUse:
    library: str
    where: str
    what: str
    buys: str
    public_path: str  # what runs instead when private_api_ok says no


FENCED = (
    PrivateUse("triton", "kernels/bitnet_launch.py (FastKernel)",
               "a compiled kernel's launcher (CompiledKernel.run, .function, .packed_metadata), "
               "JITFunction.params, triton.runtime.driver",
               "BitNet launches without JITFunction.run's per-call binding: tens of us of host "
               "time per launch, five to seven launches per layer and step",
               "kernel[grid](...) through Triton"),
    PrivateUse("triton", "kernels/adamw_lowbit.py (FusedAdamW.launch)",
               "the CompiledKernel that kernel[grid](...) returns, launched again by "
               "compiled[(grid, 1, 1)](*args)",
               "about half of the host time of each fused AdamW launch",
               "kernel[grid](...) through Triton"),
    PrivateUse("torch", "titan_lowbit/bitnet/row_reductions.py",
               "torch._inductor: config.inductor_choices_class, InductorChoices, "
               "V.set_choices_handler, MemoryDep, ReductionHint",
               "persistent (one-read) row reductions for BitNet's fused row quantizations "
               "under torch.compile: 12-29% faster norm and SwiGLU kernels on the 1B model",
               "Inductor's own choices ([lowbit] bitnet_persistent_rows has no effect)"),
    PrivateUse("torchtitan", "titan_lowbit/torchtitan/checkpoint.py (register)",
               "CheckpointManager.dcp_load, dcp_save and _find_load_step, wrapped",
               "checkpoint safety: CRC and size verification and layout checks before a "
               "load, atomic synchronous saves, a warning for incomplete step folders",
               "torchtitan's checkpointing unchanged, without those checks"),
    PrivateUse("torchtitan", "titan_lowbit/config.py (_check_keys)",
               "ConfigManager._dict_to_dataclass, wrapped",
               "an unknown TOML key is named with the valid keys of its section (torchtitan "
               "names the key and points to a script of its own repository)",
               "torchtitan's own message"),
    PrivateUse("torchtitan", "titan_lowbit/config.py (check_custom_import)",
               "ConfigManager._validate_config, wrapped",
               'a job file still naming custom_import = "titan_lowbit" (which registers '
               "nothing) stops at parse time naming the key and the integration module",
               "torchtitan's own errors for the unregistered optimizer or converter names"),
    PrivateUse("torchtitan", "titan_lowbit/torchtitan/converters.py (register)",
               "torchtitan.protocols.model_converter._registry_model_converter_cls, "
               "replaced by a dict subclass with the same contents",
               "an unknown [model] converters name is a ValueError listing the registered "
               "ones instead of a bare KeyError",
               "torchtitan's KeyError"),
)

STRUCTURAL = (
    PrivateUse("torchtitan", "titan_lowbit/torchtitan/v03.py (LowBitOptimizersContainer)",
               "OptimizersContainer._resolve_optimizer_factory (0.3 line), overridden in a subclass",
               "titan_lowbit's optimizer names valid as param-group optimizer names: torchtitan "
               "0.3 reads its name -> optimizer table there and nowhere else",
               "none (covered by the torchtitan range pyproject.toml declares, <0.4)"),
    PrivateUse("torch", "titan_lowbit/bitnet/weight.py",
               "torch.Tensor._make_wrapper_subclass, func._schema, torch._C."
               "DisableTorchFunctionSubclass, torch.autograd._unsafe_preserve_version_counter, "
               "torch.utils._pytree, aten._to_copy/_unsafe_view/_pin_memory",
               "the BitNet weight tensor subclasses and their FSDP2 all-gather extension",
               "none"),
    PrivateUse("torch", "titan_lowbit/bitnet/*.py, titan_lowbit/optim/*.py",
               "DTensor._local_tensor",
               "the persistent local tensor of a DTensor (to_local() returns a fresh view, "
               "which cannot carry per-weight caches)",
               "none"),
    PrivateUse("torch", "kernels/bitnet_quant.py (weight_abs_sums), titan_lowbit/optim/nonfinite.py",
               "torch._foreach_norm, torch._foreach_copy_",
               "one launch for the norms of all weights instead of one per weight; "
               "_foreach_norm's result for a tensor depends on that tensor alone, so a weight's "
               "sum |W| has one order on every path (bit-exact BitNet resume)",
               "none"),
    PrivateUse("torch", "titan_lowbit/bitnet/ops.py, titan_lowbit/bitnet/tensor_parallel.py, "
               "titan_lowbit/bitnet/weight.py (sum_over_ranks)",
               "torch.distributed._functional_collectives, torch._subclasses.fake_tensor.is_fake, "
               "torch._prims_common.make_contiguous_strides_for",
               "collectives and shape checks that torch.compile can trace",
               "none"),
    PrivateUse("torch", "titan_lowbit/optim/step_plan.py",
               "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
               "the global offset of a DTensor shard (stochastic-rounding streams that do not "
               "depend on the sharding)",
               "none"),
)


@functools.lru_cache(maxsize=None)
def installed(library: str) -> tuple[int, ...] | None:
    """The installed version of ``library`` as integers (local suffixes dropped), or None."""
    text = getattr(sys.modules.get(library), "__version__", None)
    if text is None:
        try:
            text = metadata.version(library)
        except metadata.PackageNotFoundError:
            return None
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def torchtitan_line() -> tuple[int, int] | None:
    """The (major, minor) line of the installed torchtitan, or None without torchtitan."""
    version = installed("torchtitan")
    return None if version is None else tuple(version[:2])


def tested(library: str) -> bool:
    """Whether the installed ``library`` is inside its ``TESTED`` range."""
    version = installed(library)
    if version is None:
        return False
    low, high = TESTED[library]
    return low <= version[:len(low)] <= high


_told: set[str] = set()


def private_api_ok(library: str) -> bool:
    """Whether the fenced private uses of ``library`` may run: its installed version is
    tested and ``TITAN_LOWBIT_PRIVATE_APIS`` is not 0. The first no per library is logged."""
    if os.environ.get(ENV, "1") == "0":
        reason = f"{ENV}=0"
    elif tested(library):
        return True
    else:
        low, high = TESTED[library]
        found = ".".join(map(str, installed(library) or ())) or "not installed"
        reason = (f"{library} {found} is outside the tested range "
                  f"{'.'.join(map(str, low))} to {'.'.join(map(str, high))}")
    if library not in _told:
        _told.add(library)
        uses = "; ".join(u.where for u in FENCED if u.library == library)
        logger.warning("titan_lowbit: %s: taking the public paths instead of %s's private APIs (%s)",
                       reason, library, uses)
    return False
