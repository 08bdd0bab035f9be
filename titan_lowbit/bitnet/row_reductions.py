"""One pass over each row for the row quantizations that Inductor fuses (torch.compile).

Under torch.compile a BitNet layer's row quantization (row abs-max, then codes scaled by
it; ``ops`` module docstring) is fused by Inductor into the kernel that produces its
input: the RMSNorm before wq/wk/wv and w1/w3, the SwiGLU product before w2, the norm's
and SwiGLU's backward for the grad_outputs. Such a kernel reduces over a row (the row's
abs-max) and then reads the row again to quantize it. Inductor keeps a row in registers
(a "persistent" reduction, one read of its inputs) only up to 1024 elements; the rows of
a 1B model are 2048 and 5632 wide, so its kernels loop over each row twice and read the
inputs twice from memory.

``PersistentRowReductions`` lets Inductor keep longer rows in registers where they fit:
rows up to ``MAX_ROW`` elements (padded to a power of two, as Inductor's persistent
kernels are) whose full-row inputs, counted in elements of one row each, are at most
``REGISTER_BUDGET``. Measured on the 1B model (docs/bitnet.md): with all rows up to 8192
persistent, the forward SwiGLU + quantization kernel (two 5632-wide inputs) and the
norms' kernels got 12 to 29% faster, but the backward SwiGLU + grad_output quantization
(three 5632-wide inputs: 24576 elements per row in registers) spilled and got 46% slower;
the budget keeps that one looped. Split reductions (few rows, each a chunk of one long
sum, as Inductor makes of a weight's sum |W|) keep Inductor's choice: persistent they
were slightly slower (``MIN_ROWS``).

The choice is Inductor's per process (``torch._inductor.config.inductor_choices_class``),
so it applies to every graph compiled after ``install`` (converter "bitnet" installs it
when ``compile.enable`` and ``[lowbit] bitnet_persistent_rows`` are on). The math is the
same either way; a persistent kernel may keep an intermediate that the looped kernel
rounds on its way through memory, as any change of Inductor's fusion may (for the
forward SwiGLU + quantization the codes and scales are bit-identical: the GPU test).
"""

from __future__ import annotations

import logging

import sympy
import torch._inductor.config as inductor_config
import triton
from torch._inductor.choices import InductorChoices
from torch._inductor.dependencies import MemoryDep
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

from titan_lowbit.kernels.private_apis import patch

logger = logging.getLogger(__name__)

# Longest row kept in registers (after padding to a power of two: 5632 -> 8192).
MAX_ROW = 8192
# Elements of full-row inputs one program may hold: 32 fp32 registers per thread of 16
# warps (Inductor's most warps for rows up to 8192).
REGISTER_BUDGET = 16384
# Fewer rows than this: a split reduction (sum |W| of a weight), left to Inductor.
MIN_ROWS = 1024


def _static_int(expr) -> int | None:
    """The value of a size that is a known integer (static shapes), else None."""
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_Integer else None


def row_inputs(features) -> int:
    """Buffers a reduction kernel reads along its rows, each a row's worth of registers:
    read from memory (not produced inside the kernel), with one element per element of
    the kernel (a full input) or one per column (a vector along the row, a norm's
    weight). Per-row values (row scales, a norm's rstd) are not counted. A size that is
    not static counts."""
    nodes = tuple(features.scheduler_nodes())
    produced = {dep.name for node in nodes for dep in node.read_writes.writes}
    row, rows = _static_int(features.reduction_numel), _static_int(features.numel)
    names = set()
    for node in nodes:
        for dep in node.read_writes.reads:
            if not isinstance(dep, MemoryDep) or dep.name in produced:
                continue
            numel = _static_int(dep.get_numel())
            if numel is None or row is None or rows is None or numel == row or numel >= rows * row:
                names.add(dep.name)
    return len(names)


def keeps_row_in_registers(features, cooperative_reduction: bool) -> bool:
    """Whether a row reduction that Inductor would loop over fits in registers
    (module docstring): an inner reduction over a static row of at most ``MAX_ROW``
    elements, at least ``MIN_ROWS`` rows, and full-row inputs within ``REGISTER_BUDGET``."""
    if not inductor_config.triton.persistent_reductions or cooperative_reduction:
        return False
    if features.get_reduction_hint() != ReductionHint.INNER:
        return False
    row, rows = _static_int(features.reduction_numel), _static_int(features.numel)
    if row is None or rows is None or rows < MIN_ROWS:
        return False
    padded = triton.next_power_of_2(row)
    return padded <= MAX_ROW and padded * row_inputs(features) <= REGISTER_BUDGET


class PersistentRowReductions(InductorChoices):
    """Inductor's choices, with persistent reductions also for rows that fit in registers
    (``keeps_row_in_registers``)."""

    @staticmethod
    def should_use_persistent_reduction(features, cooperative_reduction: bool) -> bool:
        return (InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)
                or keeps_row_in_registers(features, cooperative_reduction))


def install() -> bool:
    """Make ``PersistentRowReductions`` Inductor's choices for graphs compiled from now
    on. Leaves a different choices class that someone else installed in place (and says
    so); returns whether ours is installed."""
    current = inductor_config.inductor_choices_class
    if current is None:
        patch(inductor_config, "inductor_choices_class", PersistentRowReductions)
    elif not (isinstance(current, type) and issubclass(current, PersistentRowReductions)):
        logger.warning(
            "[lowbit] bitnet_persistent_rows: Inductor already uses the choices %r, which "
            "is left in place; BitNet's row quantizations keep Inductor's default "
            "reductions. Set [lowbit] bitnet_persistent_rows = false to silence this.",
            current)
        return False
    # Inductor builds its choices from the config once per thread, at its first use: one
    # that an earlier compile in this thread built is replaced.
    if type(V.choices) is InductorChoices:
        V.set_choices_handler(PersistentRowReductions())
    return True
