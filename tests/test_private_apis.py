"""The private-API fence (kernels/private_apis.py).

Its list: every private name of torch, Triton and torchtitan in ``titan_lowbit/`` and
``kernels/`` and every write into those libraries' module state is listed for its file, and
every listed name is still used (read from the source). Its switch: an untested library
version, or TITAN_LOWBIT_PRIVATE_APIS=0, takes the public paths with one log line per
library, and training still works there. The layers: ``kernels/`` imports nothing from above.
(The BitNet launches' public path: test_bitnet_launch.py; the fused AdamW's shared-memory
tables: test_optim_kernels.py; the traced int8 tile: test_bitnet_kernels.py.)
"""

import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from titan_lowbit.kernels import private_apis as fence

LIBRARIES = ("torch", "triton", "torchtitan")
# Attributes with a public name that are Triton's internals all the same: a JITFunction's
# parameter list, a compiled kernel's launcher and metadata, the active driver.
TRITON_INTERNALS = {"params", "is_constexpr", "run", "function", "packed_metadata", "launch_metadata",
                    "metadata", "driver"}
# Underscored names that are Python's public API (namedtuple's).
PYTHON_PUBLIC = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
# Attributes titan_lowbit keeps on objects it does not own carry one of these prefixes.
OWN_PREFIXES = ("_bitnet_", "_titan_lowbit_")
STR_METHODS = {"startswith", "endswith", "removeprefix", "removesuffix", "replace", "split", "find"}
# Calls that write into a library's module state through the fence: (owner, "name", ...).
FENCE_WRITES = {"patch", "patch_entry"}


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def source_files() -> list[Path]:
    files = sorted((ROOT / "kernels").rglob("*.py"))
    files += [p for p in sorted((ROOT / "titan_lowbit").rglob("*.py")) if "kernels" not in p.relative_to(ROOT).parts]
    return files


def _chain(node: ast.AST) -> tuple[ast.AST, list[str]]:
    """(the expression an attribute chain starts from, the attribute names in order)."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return node, names[::-1]


def _text_constants(node: ast.AST):
    """String constants under ``node`` that are text, not attribute names: parts of an
    f-string, dict keys, arguments of str methods, values compared with."""
    if isinstance(node, ast.JoinedStr):
        yield from node.values
    elif isinstance(node, ast.Subscript):
        yield from ast.walk(node.slice)
    elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in STR_METHODS:
        for arg in node.args:
            yield from ast.walk(arg)
    elif isinstance(node, ast.Compare):
        for c in node.comparators:
            yield from ast.walk(c)


def own_names(trees) -> set[str]:
    """Names titan_lowbit defines: functions, classes, arguments, variables, attributes of
    its own objects (self/cls, object.__setattr__ with a literal name), and the attributes
    it keeps on other objects (named with OWN_PREFIXES)."""
    names = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                  and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                names.add(n.attr)
            elif (isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == "__setattr__"
                  and len(n.args) > 1 and isinstance(n.args[1], ast.Constant)):
                names.add(n.args[1].value)
            elif isinstance(n, ast.Attribute) and n.attr.startswith(OWN_PREFIXES):
                names.add(n.attr)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith(OWN_PREFIXES):
                names.add(n.value)
    return names


def scan(path: Path, tree: ast.AST, own: set[str]) -> tuple[set[str], set[str]]:
    """(private names used in ``tree``, writes into the libraries outside the fence). A name
    reached from an import is written from the library (``torch._foreach_norm``); one reached
    through another object as ``*.attr``."""
    aliases, found, writes = {}, set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name.split(".")[0] in LIBRARIES and any(map(_private, a.name.split("."))):
                    found.add(a.name)
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            for a in n.names:
                full = f"{n.module}.{a.name}"
                aliases[a.asname or a.name] = full
                if n.module.split(".")[0] in LIBRARIES and any(map(_private, full.split("."))):
                    found.add(full)
    triton_file = any(v.split(".")[0] == "triton" for v in aliases.values())

    def library_path(node) -> list[str] | None:
        root, names = _chain(node)
        if isinstance(root, ast.Name) and aliases.get(root.id, "").split(".")[0] in LIBRARIES:
            return aliases[root.id].split(".") + names
        return None

    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    not_names = {id(c) for n in ast.walk(tree) for c in _text_constants(n)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and id(n) in inner:
            continue  # part of a longer chain, which is read whole
        if isinstance(n, ast.Attribute):
            full = library_path(n)
            if full is not None:
                if any(map(_private, full)) or (full[0] == "triton" and TRITON_INTERNALS & set(full)):
                    found.add(".".join(full))
                continue
            root, names = _chain(n)
            if isinstance(root, ast.Name) and root.id in aliases:
                continue  # a module of titan_lowbit or of the standard library
            for i, name in enumerate(names):
                if (_private(name) and name not in own | PYTHON_PUBLIC) or (
                        triton_file and name in TRITON_INTERNALS
                        and not (i == 0 and isinstance(root, ast.Name) and root.id == "self")):
                    found.add("*." + name)
        elif (isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier()
              and _private(n.value) and n.value not in own and id(n) not in not_names):
            found.add("*." + n.value)  # an attribute's name, for getattr, attrgetter, ...
        elif isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            for target in getattr(n, "targets", None) or [n.target]:
                base = target.value if isinstance(target, ast.Subscript) else target
                if isinstance(target, (ast.Attribute, ast.Subscript)) and library_path(base) is not None:
                    writes.add(".".join(library_path(base)))
        elif isinstance(n, ast.Call) and n.args:
            func = getattr(n.func, "id", getattr(n.func, "attr", None))
            owner = library_path(n.args[0]) if isinstance(n.args[0], (ast.Name, ast.Attribute)) else None
            if func in ("setattr", "delattr") and owner is not None:
                writes.add(".".join(owner))
            elif (func in FENCE_WRITES and owner is not None and len(n.args) > 1
                  and isinstance(n.args[1], ast.Constant)):
                found.add(".".join(owner + [n.args[1].value]))
    return found, writes


@pytest.fixture(scope="module")
def uses() -> dict[str, tuple[set[str], set[str]]]:
    """Per repository path: (private names used, writes outside the fence)."""
    trees = {p: ast.parse(p.read_text(), str(p)) for p in source_files()}
    own = own_names(trees.values())
    return {str(p.relative_to(ROOT)): scan(p, t, own) for p, t in trees.items()}


def test_every_private_use_is_listed_for_its_file(uses):
    unlisted = sorted(f"{path}: {name}" for path, (found, _) in uses.items() for name in found
                      if fence.listed(name, path) is None)
    assert not unlisted, ("private names used but not listed in kernels/private_apis.py "
                          "(PRIVATE_USES):\n  " + "\n  ".join(unlisted))


def test_writes_into_the_libraries_go_through_the_fence(uses):
    direct = sorted(f"{path}: {name}" for path, (_, writes) in uses.items() for name in writes)
    assert not direct, ("module state of torch/Triton/torchtitan written directly; use "
                        "private_apis.patch or patch_entry, and list it:\n  " + "\n  ".join(direct))


def test_every_listed_name_is_still_used(uses):
    """No entry outlives its use: each listed name (a pattern aside: its writes are chosen
    at run time, where patch checks them) is used in one of its entry's files."""
    stale = []
    for use in fence.PRIVATE_USES:
        for name in use.names:
            if "*" in name:
                continue
            if not any(fence.in_files(path, use.files) and any(fence.covers(name, f) for f in found)
                       for path, (found, _) in uses.items()):
                stale.append(f"{name} ({', '.join(use.files)})")
    assert not stale, "listed but not used any more:\n  " + "\n  ".join(stale)


def test_each_entry_says_its_library_and_files():
    for use in fence.PRIVATE_USES:
        assert use.library in fence.TESTED and use.names and use.buys, use
        for f in use.files:
            assert (ROOT / f).is_dir() if f.endswith("/") else (ROOT / f).is_file(), f


def test_the_cpu_paths_device_globals_are_listed():
    """cpu_device chooses the modules it writes at run time (per torchtitan line)."""
    from titan_lowbit.torchtitan.cpu_device import DEVICE_GLOBALS

    for holders in DEVICE_GLOBALS.values():
        for module, names in holders.items():
            for name in names:
                assert fence.listed(f"{module}.{name}", "titan_lowbit/torchtitan/cpu_device.py"), (module, name)


def test_patch_refuses_an_unlisted_target(monkeypatch):
    import torchtitan.tools.utils as tt_utils

    with pytest.raises(RuntimeError, match=r"torchtitan.tools.utils.some_global is not in the list"):
        fence.patch(tt_utils, "some_global", 1)
    with pytest.raises(RuntimeError, match=r"DATASETS_ELSEWHERE is not in the list"):
        fence.patch_entry(tt_utils, "DATASETS_ELSEWHERE", "x", 1)
    assert not hasattr(tt_utils, "some_global")


def test_kernels_import_nothing_from_above():
    """kernels/ is the lowest layer: no import of titan_lowbit (it is imported as
    titan_lowbit.kernels; its modules import each other relatively) and none above it."""
    upward = []
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                upward += [f"{path.name}: import {a.name}" for a in n.names if a.name.split(".")[0] == "titan_lowbit"]
            elif isinstance(n, ast.ImportFrom):
                if n.level > 1 or (n.level == 0 and (n.module or "").split(".")[0] == "titan_lowbit"):
                    upward.append(f"{path.name}: from {'.' * n.level}{n.module or ''} import ...")
    assert not upward, upward


def test_an_untested_version_is_refused_once_per_library(monkeypatch, caplog):
    monkeypatch.setattr(fence, "_told", set())
    monkeypatch.delenv(fence.ENV, raising=False)
    assert fence.private_api_ok("torch") and fence.private_api_ok("triton")
    torch_version = fence.installed("torch")
    monkeypatch.setitem(fence.TESTED, "torch", ((1, 0), (1, 99)))
    with caplog.at_level(logging.WARNING, logger=fence.__name__):
        assert not fence.private_api_ok("torch")
        assert not fence.private_api_ok("torch")
        assert fence.private_api_ok("triton")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    found = ".".join(map(str, torch_version))
    assert f"torch {found} is outside the tested range 1.0 to 1.99" in lines[0], lines
    assert "row_reductions.py" in lines[0], lines  # names where the public path is taken


def test_the_switch_takes_every_public_path(monkeypatch):
    monkeypatch.setattr(fence, "_told", set())
    monkeypatch.setenv(fence.ENV, "0")
    assert not any(fence.private_api_ok(lib) for lib in fence.TESTED)
    assert {u.library for u in fence.PRIVATE_USES if u.public_path} == set(fence.TESTED)


PUBLIC_RUN = r"""
import torch
import torch.nn as nn
import titan_lowbit.torchtitan  # registers with torchtitan, as custom_import does
import titan_lowbit.config
import torchtitan.protocols.model_converter as mc
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.config.manager import ConfigManager
import torch._inductor.config as inductor_config
from titan_lowbit.bitnet import BitNetConverter, convert_to_bitnet
from titan_lowbit.optim import LowBitAdamW

assert not getattr(CheckpointManager.dcp_load, "titan_lowbit_checked", False)
assert not getattr(ConfigManager._dict_to_dataclass, "titan_lowbit_checked", False)
assert type(mc._registry_model_converter_cls) is dict
assert mc._registry_model_converter_cls["bitnet"] is BitNetConverter


class Job:  # what BitNetConverter reads of a JobConfig
    class compile:
        enable = True


BitNetConverter(Job(), parallel_dims=None)
assert inductor_config.inductor_choices_class is None

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
convert_to_bitnet(model, filter_fqns=())
opt = LowBitAdamW(model.parameters(), lr=1e-3, min_quantized_numel=1)
for _ in range(2):
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
assert all(torch.isfinite(p).all() for p in model.parameters())
print("public-paths-ok")
"""


def test_training_on_the_public_paths():
    """In a fresh process with TITAN_LOWBIT_PRIVATE_APIS=0: torchtitan's checkpointing,
    config loader and converter registry are left as they are (the converters still
    registered), Inductor's
    choices are not replaced, and a BitNet model trains with LowBitAdamW."""
    env = {**os.environ, fence.ENV: "0", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", PUBLIC_RUN], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "public-paths-ok" in proc.stdout, proc.stderr[-4000:]
    said = [l for l in proc.stderr.splitlines() if "taking the public paths" in l]
    assert sorted(l.split("instead of ")[1].split("'s")[0] for l in said) == ["torch", "torchtitan"], said
