"""The private APIs of torch, Triton, Inductor and torchtitan that titan_lowbit uses: one
list (``PRIVATE_USES``), what each use buys, and the versions it was tested with (``TESTED``).

A private name can change in any release. A use whose gain is speed or a check around
torchtitan has a public path: it asks :func:`private_api_ok` first, which says no when the
installed version of that library is outside ``TESTED`` (or when
``TITAN_LOWBIT_PRIVATE_APIS=0`` asks for the public paths, e.g. to rule the private uses out
while debugging). Then the public path runs, same results, and one log line per library
names the version and the tested range. A use without a public path (``public_path`` None)
is how torch tensor subclasses and DTensor code are written, or how torchtitan is told
about titan_lowbit where it has no registration function; those are covered by the ranges
that pyproject.toml declares.

Module state of torch, Triton or torchtitan (a module's global, a class's method, an entry
of a module's table) is changed only through :func:`patch` and :func:`patch_entry`, which
refuse a target this list does not name. ``tests/test_private_apis.py`` reads the source of
``titan_lowbit/`` and ``kernels/`` and fails on a private name, or a write into those
libraries, that no entry lists for its file, and on an entry whose names its files no
longer use.

Why the list lives in ``kernels/``: the kernels consult it (the launch caches, the shared
memory tables, the traced tile timing) and the kernels layer imports nothing from above
it. Every layer above reads the same module (``titan_lowbit.kernels.private_apis``). It
imports nothing but the standard library.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import os
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType

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
ENV = "TITAN_LOWBIT_PRIVATE_APIS"


@dataclass(frozen=True)
class PrivateUse:
    """One private use. ``names`` as the source names them: a dotted path from the library
    (``torch._foreach_norm``; a listed module or class also covers its members), or
    ``Class.attribute`` for an attribute reached through an object (``DTensor._local_tensor``),
    or a pattern (``torchtitan.*.device_type``) for a write whose target is chosen at run time.
    ``files``: repository paths, a folder ending in ``/``."""

    library: str
    files: tuple[str, ...]
    names: tuple[str, ...]
    buys: str
    public_path: str | None  # what runs when private_api_ok says no; None: there is none


PRIVATE_USES = (
    # -- with a public path: each asks private_api_ok(library) first -----------------------
    PrivateUse(
        "triton", ("kernels/bitnet_launch.py", "kernels/bitnet_matmul.py"),
        ("JITFunction.params", "KernelParam.is_constexpr", "CompiledKernel.run",
         "CompiledKernel.function", "CompiledKernel.packed_metadata",
         "CompiledKernel.launch_metadata", "triton.runtime.driver"),
        "BitNet launches from a cache of compiled kernels (FastKernel), without "
        "JITFunction.run's per-call binding: tens of us of host time per launch, five to seven "
        "launches per layer and step; the cached TMA launches build their descriptors without "
        "TensorDescriptor's checks (_CheckedDescriptor)",
        "kernel[grid](...) through Triton"),
    PrivateUse(
        "triton", ("kernels/adamw_lowbit.py",),
        ("CompiledKernel.metadata",),
        "the fused AdamW kernel: its launch cache (the CompiledKernel that kernel[grid](...) "
        "returns, launched again with compiled[(grid, 1, 1)](*args): about half of each "
        "launch's host time), and its code tables kept in shared memory once per program "
        "(PTX at Triton's global_smem symbol; the reservation read from metadata.shared)",
        "kernel[grid](...) through Triton, and the tables read with tl.gather"),
    PrivateUse(
        "torch", ("kernels/bitnet_matmul.py",),
        ("torch.utils._python_dispatch._disable_current_modes",),
        "while torch.compile traces a BitNet linear of a new shape: the int8 matmul variant "
        "and tile chosen by timing them on real scratch operands",
        "the pointer variant, with the tile an eager launch of the shape chose, else the "
        "first tile"),
    PrivateUse(
        "torch", ("titan_lowbit/bitnet/row_reductions.py",),
        ("torch._inductor",),
        "persistent (one-read) row reductions for BitNet's fused row quantizations under "
        "torch.compile (config.inductor_choices_class, InductorChoices, V.set_choices_handler, "
        "MemoryDep, ReductionHint): 12-29% faster norm and SwiGLU kernels on the 1B model",
        "Inductor's own choices (bitnet_persistent_rows has no effect)"),
    PrivateUse(
        "torchtitan", ("titan_lowbit/torchtitan/checkpoint.py",),
        ("torchtitan.components.checkpoint.CheckpointManager.__init__",
         "torchtitan.components.checkpoint.CheckpointManager.dcp_load",
         "torchtitan.components.checkpoint.CheckpointManager.dcp_save",
         "torchtitan.components.checkpoint.CheckpointManager._find_load_step"),
        "checkpoint safety: CRC and size verification and layout checks before a load, "
        "atomic synchronous saves, a warning for incomplete step folders, async saves "
        "refused at start-up (the methods wrapped)",
        "torchtitan's checkpointing unchanged, without those checks"),
    PrivateUse(
        "torchtitan", ("titan_lowbit/config.py",),
        ("torchtitan.config.manager.ConfigManager._dict_to_dataclass",),
        "an unknown TOML key is named with the valid keys of its section (torchtitan names "
        "the key and points to a script of its own repository)",
        "torchtitan's own message"),
    PrivateUse(
        "torchtitan", ("titan_lowbit/config.py",),
        ("torchtitan.config.manager.ConfigManager._validate_config",),
        'a job file still naming custom_import = "titan_lowbit" (which registers nothing) '
        "stops at parse time naming the key and the integration module",
        "torchtitan's own errors for the unregistered optimizer or converter names"),
    PrivateUse(
        "torchtitan", ("titan_lowbit/torchtitan/converters.py",),
        ("torchtitan.protocols.model_converter._registry_model_converter_cls",),
        "an unknown [model] converters name is a ValueError listing the registered ones "
        "instead of a bare KeyError (the registry replaced by a dict subclass, same contents)",
        "torchtitan's KeyError"),
    # -- without a public path: covered by the declared ranges ------------------------------
    PrivateUse(
        "torchtitan", ("titan_lowbit/torchtitan/train_spec.py",),
        ("torchtitan.protocols.train_spec.get_train_spec",),
        "torchtitan 0.2: every train spec wrapped so [optimizer] and [lowbit] reach its "
        "builders (the Trainer's one lookup of a spec, replaced)",
        None),
    PrivateUse(
        "torchtitan", ("titan_lowbit/torchtitan/datasets.py",),
        ("torchtitan.hf_datasets.text_datasets.DATASETS",),
        "torchtitan 0.2 and 0.3: the offline lowbit_text datasets, added to torchtitan's "
        "dataset table (it has no registration function)",
        None),
    PrivateUse(
        "torchtitan", ("titan_lowbit/torchtitan/flavors.py",),
        ("torchtitan.models.llama3.llama3_args",),
        "torchtitan 0.2: the 1B llama3 flavor, added to torchtitan's flavor table",
        None),
    PrivateUse(
        "torchtitan", ("titan_lowbit/torchtitan/cpu_device.py",),
        ("torchtitan.*.device_type", "torchtitan.*.device_module"),
        "the CPU path: torchtitan's device globals pointed at the CPU in every module that "
        "holds a copy (cpu_device.DEVICE_GLOBALS, per line)",
        None),
    PrivateUse(
        "torchtitan", ("titan_lowbit/torchtitan/v03.py",),
        ("torchtitan.components.optimizer.OptimizersContainer._resolve_optimizer_factory",
         "torchtitan.components.optimizer.OptimizersContainer._build_param_groups",
         "Module._sharding_config"),
        "torchtitan 0.3: titan_lowbit's optimizer names valid as param-group optimizer names "
        "(0.3 reads its name -> optimizer table there and nowhere else, overridden in a "
        "subclass); which parameters the container will give a param group that keeps fp32 "
        "master weights, by torchtitan's own assignment, before the model initializes "
        "(fp32 init of those weights); a SubLN input norm sharded like torchtitan's block norms",
        None),
    PrivateUse(
        "torch", ("titan_lowbit/torchtitan/cpu_device.py",),
        ("torch.distributed.tensor.DTensor._op_dispatcher._custom_op_handlers",),
        "the CPU path: DTensor's random fills on a CPU mesh drawn whole and sharded, the "
        "values one process draws (torch fills every shard alike there)",
        None),
    PrivateUse(
        "torch", ("titan_lowbit/bitnet/weight.py", "titan_lowbit/bitnet/ops.py"),
        ("torch.Tensor._make_wrapper_subclass", "torch._C.DisableTorchFunctionSubclass",
         "torch.autograd._unsafe_preserve_version_counter", "torch.utils._pytree",
         "OpOverload._schema", "Tensor._version", "torch.ops.aten._to_copy",
         "torch.ops.aten._unsafe_view", "torch.ops.aten._pin_memory"),
        "the BitNet weight tensor subclasses and their FSDP2 all-gather extension",
        None),
    PrivateUse(
        "torch", ("titan_lowbit/bitnet/", "titan_lowbit/optim/"),
        ("DTensor._local_tensor", "DTensor._spec"),
        "the persistent local tensor of a DTensor (to_local() returns a fresh view, which "
        "cannot carry per-weight caches); its spec, compared by identity with the gradient's "
        "(one check per step that every gradient is sharded as its weight)",
        None),
    PrivateUse(
        "torch", ("kernels/bitnet_quant.py", "titan_lowbit/bitnet/weight.py", "titan_lowbit/optim/"),
        ("torch._foreach_norm", "torch._foreach_copy_"),
        "one launch for the norms (copies) of all weights instead of one per weight; "
        "_foreach_norm's result for a tensor depends on that tensor alone, so a weight's "
        "sum |W| has one order on every path (bit-exact BitNet resume)",
        None),
    PrivateUse(
        "torch", ("titan_lowbit/bitnet/ops.py", "titan_lowbit/bitnet/tensor_parallel.py",
                  "titan_lowbit/bitnet/weight.py"),
        ("torch.distributed._functional_collectives", "torch._subclasses.fake_tensor.is_fake",
         "torch._prims_common.make_contiguous_strides_for"),
        "collectives and shape checks that torch.compile can trace",
        None),
    PrivateUse(
        "torch", ("titan_lowbit/optim/",),
        ("torch.distributed.tensor._utils.compute_local_shape_and_global_offset",),
        "the global offset of a DTensor shard (stochastic-rounding streams that do not "
        "depend on the sharding; the rectangles that sharded Muon's exchange assembles "
        "whole matrices from)",
        None),
    PrivateUse(
        "torch", ("titan_lowbit/optim/muon_exchange.py",),
        ("torch.distributed.tensor.placement_types._StridedShard",),
        "recognising FSDP2's strided shard of a tensor-parallel dimension, whose shards are "
        "rectangles that sharded Muon's exchange can assemble (DTensor has no public name "
        "for it, and its is_shard() says False)",
        None),
)


def covers(listed: str, found: str) -> bool:
    """Whether the listed name ``listed`` covers the name ``found``: the same, a member of
    it, a match of its pattern, or (``found`` = ``*.attr``, an attribute of an object whose
    type the source does not say) the same attribute."""
    if found.startswith("*."):
        return listed.endswith(found[1:])
    if "*" in listed:
        return fnmatch.fnmatchcase(found, listed)
    return found == listed or found.startswith(listed + ".")


def in_files(path: str, files: tuple[str, ...]) -> bool:
    return any(path == f or (f.endswith("/") and path.startswith(f)) for f in files)


def listed(name: str, path: str | None = None) -> PrivateUse | None:
    """The entry of PRIVATE_USES that covers ``name`` (in the file ``path``, when given)."""
    for use in PRIVATE_USES:
        if (path is None or in_files(path, use.files)) and any(covers(n, name) for n in use.names):
            return use
    return None


def _target(owner, name: str) -> str:
    if isinstance(owner, ModuleType):
        return f"{owner.__name__}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def _check_listed(target: str) -> None:
    if listed(target) is None:
        raise RuntimeError(f"titan_lowbit: {target} is not in the list of private uses "
                           f"(kernels/private_apis.py, PRIVATE_USES); add it there with what it buys")


def patch(owner, name: str, value) -> None:
    """``owner.name = value`` for a module or class of torch, Triton or torchtitan, where
    PRIVATE_USES lists ``owner.name``."""
    _check_listed(_target(owner, name))
    setattr(owner, name, value)


def patch_entry(owner, table: str, key, value) -> None:
    """``owner.table[key] = value`` (an entry of a module's table, e.g. torchtitan's
    datasets; ``table`` may be a dotted path of attributes, e.g. a table of an object that
    a class holds), where PRIVATE_USES lists ``owner.table``."""
    _check_listed(_target(owner, table))
    functools.reduce(getattr, table.split("."), owner)[key] = value


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


def tested(library: str) -> bool:
    """Whether the installed ``library`` is inside its ``TESTED`` range."""
    version = installed(library)
    if version is None:
        return False
    low, high = TESTED[library]
    return low <= version[:len(low)] <= high


_told: set[str] = set()


def private_api_ok(library: str) -> bool:
    """Whether the private uses of ``library`` that have a public path may run: its installed
    version is tested and ``TITAN_LOWBIT_PRIVATE_APIS`` is not 0. The first no per library is
    logged, naming the files that take their public path."""
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
        files = sorted({f for u in PRIVATE_USES if u.library == library and u.public_path for f in u.files})
        logger.warning("titan_lowbit: %s: taking the public paths instead of %s's private APIs (%s)",
                       reason, library, "; ".join(files))
    return False
