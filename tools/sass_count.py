#!/usr/bin/env python3
"""Count the SASS instructions of the fused AdamW kernel per element, without a GPU.

The optimizer step is bound by instruction issue and shared-memory traffic, not DRAM
(docs/optimizer.md), so the number of instructions per element is the figure to cut. This
script compiles ``_adamw_lowbit_kernel`` for a Hopper target (sm_90 by default) with
Triton's own compiler, ptxas and nvdisasm (all shipped in the triton wheel), for the launch
family a configuration uses on the TinyLlama parameter set (aligned, whole tiles, dense
stochastic-rounding indices below 2**32), and prints:

    config, registers, shared memory, SASS instructions, instructions per element

"SASS" is per thread (each holds elements / (32 * warps) of them); "per element" =
(instructions at E elements per program - at E/2) / (elements per thread added), so the
per-program part (metadata, table stores, block maxima) drops out. The counts are static
(every instruction of the kernel body once; the subroutines after it, slow paths of exact
division that never run, are left out); the body is straight-line, so they track what
Nsight Compute executes. Needs a triton with its NVIDIA backend (any machine with the
triton wheel; use the GPU's triton version, e.g. with ``PYTHONPATH`` pointing at it):

    python3 tools/sass_count.py --format 8bit 4bit --dtype bfloat16 --update stochastic
    python3 tools/sass_count.py --format 4bit --dump /tmp/k.sass   # the SASS itself
    python3 tools/sass_count.py --check-scratch   # Triton's own shared memory vs the tables' gap
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from titan_lowbit.kernels import adamw_lowbit as K
from titan_lowbit.optim.formats import STATE_FORMATS

_TRITON_TYPE = {"float32": "fp32", "bfloat16": "bf16"}


def _signature(fmt, dtype: str, update: str) -> tuple[dict, dict]:
    """Argument types and constexprs of one launch family (as the optimizer launches it)."""
    wdt = _TRITON_TYPE[dtype]
    quant = fmt.m_codec != K.CODEC_NONE
    state = "u8" if quant else ("bf16" if fmt.plain_dtype == torch.bfloat16 else "fp32")
    extra = {"master": "fp32", "kahan": "bf16", "master_remainder": "i16"}.get(update, wdt) if dtype == "bfloat16" else wdt
    sig = {
        "tiles_ptr": "*i32", "meta_ptr": "*i64", "grad_offsets_ptr": "*i64",
        "tables_ptr": "*fp32", "enc_tables_ptr": "*u8", "smem_image_ptr": "*i32", "lr_ptr": "*fp32",
        "flags_ptr": "*i32",
        "p_base": f"*{wdt}", "g_base": f"*{wdt}", "m_base": f"*{state}", "v_base": f"*{state}",
        "ms_base": "*fp32", "vs_base": "*fp32", "x_base": f"*{extra}", "n_tiles": "i32",
        "tiles": "i32",
    }
    for name in ("lr_value", "inv_bc1", "inv_sqrt_bc2", "beta1", "one_minus_beta1", "beta2",
                 "one_minus_beta2", "eps", "wd"):
        sig[name] = "fp32"
    sig["skey"] = "i32"
    sig["flag_tag"] = "i32"
    const = dict(M_CODEC=fmt.m_codec, V_CODEC=fmt.v_codec,
                 UPDATE=K.WEIGHT_UPDATES[update] if dtype == "bfloat16" else K.UPDATE_NEAREST,
                 DECOUPLED=True, LR_IS_TENSOR=False, ALIGNED=True, EVEN=True, SR_DENSE=True,
                 SR_IDX32=True, HW_CAST=True, QBLOCK=fmt.default_block, GUARD=False)
    return sig, const


def _table_constants(fmt, elems: int) -> dict:
    """The shared-memory table layout constants of a launch family (as FusedAdamW sets them)."""
    return dict(zip(("M_SMEM", "V_SMEM", "SMEM_WORDS"), K.smem_layout(fmt.m_codec, fmt.v_codec, elems)))


def compile_family(fmt, dtype: str, update: str, elems: int, warps: int, arch: int, maxnreg=None,
                   **overrides):
    """Compile one launch family for ``sm_{arch}`` (no GPU needed); ``overrides`` replace
    compile-time constants (e.g. ``EVEN=False`` for the masked variant)."""
    sig, const = _signature(fmt, dtype, update)
    const["NB"] = max(1, elems // fmt.default_block)
    const.update(_table_constants(fmt, elems))
    const.update(overrides)
    for k in const:
        sig[k] = "constexpr"
    names = K._adamw_lowbit_kernel.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
             if v.startswith("*") and const["ALIGNED"]}
    src = ASTSource(fn=K._adamw_lowbit_kernel, signature=sig, constexprs=const, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    opts = {"num_warps": warps}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    options = backend.parse_options(opts)
    return triton.compile(src, target=target, options=options.__dict__)


def _cuda_tool(tool: str, flag: str, cc) -> str:
    """Output of one of the triton wheel's CUDA tools (nvdisasm, cuobjdump) on the cubin."""
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cc.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(bindir, tool), flag, f.name], check=True,
                              capture_output=True, text=True).stdout


def sass_of(cc) -> str:
    return _cuda_tool("nvdisasm", "-c", cc)


def resources(cc) -> tuple[int, int]:
    """(registers per thread, shared memory bytes) that ptxas reports for the cubin."""
    out = _cuda_tool("cuobjdump", "-res-usage", cc)
    return int(re.search(r"REG:(\d+)", out).group(1)), cc.metadata.shared


def count(sass: str) -> int:
    """Instructions of the kernel body in a SASS listing: NOPs and the subroutines after it
    (the slow paths of exact division, taken only for operands near the fp32 range ends) are
    not counted."""
    n = 0
    for line in sass.splitlines():
        if line.lstrip().startswith(".weak"):  # the never-taken slow paths (exact division) follow
            break
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and not m.group(2).startswith("NOP"):
            n += 1
    return n


def _scratch_of(job: tuple) -> int:
    """Shared memory Triton needs for one family of ``check_scratch`` (run in a worker)."""
    fname, dtype, update, aligned, even, block, guard, elems, warps, arch = job
    fmt = STATE_FORMATS[fname]
    cc = compile_family(fmt, dtype, update, elems, warps, arch,
                        maxnreg=K.GUARD_MAXNREG if guard else None, ALIGNED=aligned, EVEN=even,
                        SR_DENSE=even, SR_IDX32=even, QBLOCK=block, NB=max(1, elems // block),
                        SMEM_WORDS=256, GUARD=guard)
    return cc.metadata.shared


def check_scratch(arch: int) -> bool:
    """Compile every family that keeps code tables in shared memory with a 256-word image
    instead of the tables (1 KB, below every gap; the tables' PTX names Triton's shared
    memory, which a kernel without any does not declare, and a smaller image could be
    gathered within a warp, without it) and compare the shared memory Triton then needs
    (its own layout conversions in the tile loop, or the image's 1 KB) with the gap the
    tables leave it (``smem_gap``). True if every family fits; a family that does not would
    overwrite the tables. The compiles run in one process per CPU core."""
    jobs = []
    for fname, fmt in STATE_FORMATS.items():
        if K.smem_layout(fmt.m_codec, fmt.v_codec, 1024)[2] == 0:
            continue
        for dtype, update in (("float32", "nearest"), ("bfloat16", "nearest"), ("bfloat16", "stochastic"),
                              ("bfloat16", "kahan"), ("bfloat16", "master"), ("bfloat16", "master_remainder")):
            for aligned, even in ((True, True), (True, False), (False, True), (False, False)):
                # the non-finite guard's variant (launched with its register cap) at the
                # default block
                for block, guard in sorted({(fmt.default_block, False), (64, False), (fmt.default_block, True)}):
                    cfg = K.AdamWConfig(fmt.m_codec, fmt.v_codec, False, block, K.WEIGHT_UPDATES[update],
                                        True, getattr(torch, dtype), getattr(torch, dtype))
                    elems, warps = K.launch_shape(cfg)
                    jobs.append((fname, dtype, update, aligned, even, block, guard, elems, warps, arch))
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a clean Triton in each worker
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=ctx) as pool:
        needs = list(pool.map(_scratch_of, jobs))
    ok = True
    print(f"{'format':>6} {'weights':>9} {'update':>10} {'aligned':>7} {'even':>5} {'block':>5} {'guard':>5} "
          f"{'triton scratch':>14} {'gap':>6}")
    for job, need in zip(jobs, needs):
        fname, dtype, update, aligned, even, block, guard, elems, _, _ = job
        gap = K.smem_gap(elems)
        fits = need <= gap
        ok &= fits
        print(f"{fname:>6} {dtype:>9} {update:>10} {aligned!s:>7} {even!s:>5} {block:>5} {guard!s:>5} "
              f"{need:>14} {gap:>6}{'' if fits else '  OVERLAPS THE TABLES'}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", nargs="+", default=["8bit", "4bit"], choices=sorted(STATE_FORMATS))
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=sorted(_TRITON_TYPE))
    ap.add_argument("--update", nargs="+", default=["stochastic"], choices=sorted(K.WEIGHT_UPDATES))
    ap.add_argument("--elems", type=int, default=None, help="elements per program (default: the launch shape's)")
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap passed to ptxas")
    ap.add_argument("--dump", default=None, help="write the SASS of the last configuration here")
    ap.add_argument("--check-scratch", action="store_true",
                    help="check that Triton's own shared memory stays below the code tables, for every family "
                         "(exit 1 if not)")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}")
    if args.check_scratch:
        sys.exit(0 if check_scratch(args.arch) else 1)
    print(f"{'format':>6} {'weights':>9} {'update':>10} {'elems x warps':>13} {'regs':>5} {'smem':>6} "
          f"{'SASS':>6} {'per elem':>9}")
    for fname in args.format:
        fmt = STATE_FORMATS[fname]
        for dtype in args.dtype:
            for update in (args.update if dtype == "bfloat16" else ["nearest"]):
                cfg = K.AdamWConfig(fmt.m_codec, fmt.v_codec, fmt.plain_dtype == torch.bfloat16,
                                    fmt.default_block, K.WEIGHT_UPDATES[update], True,
                                    getattr(torch, dtype), getattr(torch, dtype))
                elems, warps = K.launch_shape(cfg, args.elems, args.warps)
                cc = compile_family(fmt, dtype, update, elems, warps, args.arch, args.maxnreg)
                # the half-size program keeps the full one's shared-memory table layout, so
                # the per-program table store is the same in both and drops out
                half = compile_family(fmt, dtype, update, elems // 2, warps, args.arch, args.maxnreg,
                                      **_table_constants(fmt, elems))
                sass = sass_of(cc)
                n, nh = count(sass), count(sass_of(half))
                # per thread: elements / (32 * warps) of them, in registers
                per = (n - nh) / ((elems - elems // 2) / (32 * warps))
                regs, smem = resources(cc)
                label = "exact" if dtype == "float32" else update
                print(f"{fname:>6} {dtype:>9} {label:>10} {f'{elems} x {warps}':>13} {regs:>5} "
                      f"{smem:>6} {n:>6} {per:>9.2f}")
                if args.dump:
                    with open(args.dump, "w") as f:
                        f.write(sass)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
