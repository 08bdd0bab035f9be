"""The iterator of the kernels' loops whose bounds are known only at run time.

Compiled, it is ``tl.range``: without options the compiler builds the same loop from it as
from Python's ``range`` written in a kernel (one ``scf.for`` over the same bounds), so the
compiled kernels are the ones ``range`` gives.

Under Triton's interpreter (``TRITON_INTERPRET=1``) it is a generator that steps the loop
variable itself and ends the loop on a compare. A run-time scalar there is a one-element
array, and Python's ``range`` needs an ``int`` from it: Triton 3.6's interpreter converts
with ``int()`` of that array, which NumPy 2.4 and later refuse ("only 0-dimensional
arrays can be converted to Python scalars"), while a compare's truth value is read the
same way by every NumPy. The loop runs the same iterations in the same order on every
Triton the package supports.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _interpreted_range(start, end=None, step=1, **_compiler_options):
    """``range(start, end, step)`` (step > 0) over ints or the interpreter's scalars; the
    options of ``tl.range`` (stages, flattening) only steer the compiler."""
    if end is None:
        start, end = 0, start
    i = start
    while i < end:
        yield i
        i = i + step


def kernel_range():
    """The iterator for the loops of kernels decorated now: Triton decides when it decorates
    a kernel whether the interpreter runs it, so a kernel module calls this at import, next
    to its kernels."""
    return _interpreted_range if triton.knobs.runtime.interpret else tl.range
