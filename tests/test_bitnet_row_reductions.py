"""Inductor's persistent reductions for BitNet's row quantizations (bitnet/row_reductions.py).

On CPU: the decision on kernel descriptions built from Inductor's own dependency records,
the installation, and the converter's option. On a GPU: a compiled row quantization whose
row fits runs as one persistent kernel and gives the same codes and scales as Inductor's
default looped kernel.
"""

import logging
from types import SimpleNamespace

import pytest
import sympy
import torch
import torch._inductor.config as inductor_config
from torch._inductor.choices import InductorChoices
from torch._inductor.dependencies import MemoryDep
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

from titan_lowbit.bitnet import CONVERTERS
from titan_lowbit.bitnet import row_reductions as rr
from titan_lowbit.config import LowBit
from titan_lowbit.kernels import bitnet_quant as bq

C0, C1 = sympy.symbols("c0 c1", integer=True, nonnegative=True)


def _dep(name: str, rows, row, kind: str) -> MemoryDep:
    """A read of ``name`` inside a [rows, row] reduction kernel: the full input, one value
    per row, or one per column."""
    index = {"full": C0 * row + C1, "per_row": C0, "per_col": C1}[kind]
    return MemoryDep(name, index, (C0, C1), (sympy.Integer(rows) if isinstance(rows, int) else rows,
                                              sympy.Integer(row) if isinstance(row, int) else row))


def _features(rows, row, reads, writes=(), hint=ReductionHint.INNER):
    """A stand-in for Inductor's SIMDKernelFeatures: one node reading ``reads``
    ((name, kind) pairs) and writing ``writes``."""
    node = SimpleNamespace(read_writes=SimpleNamespace(
        reads={_dep(n, rows, row, k) for n, k in reads},
        writes={_dep(n, rows, row, "full") for n in writes}))
    return SimpleNamespace(
        numel=sympy.sympify(rows), reduction_numel=sympy.sympify(row),
        scheduler_nodes=lambda: (node,), get_reduction_hint=lambda: hint)


def _full(*names):
    return [(n, "full") for n in names]


def test_rows_whose_inputs_fit_are_kept_in_registers():
    # the forward SwiGLU + quantization of w2's input: two 5632-wide inputs (8192 padded)
    assert rr.keeps_row_in_registers(_features(16384, 5632, _full("x1", "x3")), False)
    # a norm's backward over 2048-wide rows: six inputs, one of them the norm's weight
    six = _full("dy", "x", "a", "b", "c") + [("weight", "per_col")]
    assert rr.row_inputs(_features(16384, 2048, six)) == 6
    assert rr.keeps_row_in_registers(_features(16384, 2048, six), False)


def test_rows_that_would_spill_stay_looped():
    # the backward SwiGLU + grad_output quantization: three 5632-wide inputs (measured
    # 46% slower persistent); its two row scales are per-row values and do not count
    feats = _features(16384, 5632, _full("dh", "x1", "x3") + [("s1", "per_row"), ("s2", "per_row")])
    assert rr.row_inputs(feats) == 3
    assert not rr.keeps_row_in_registers(feats, False)
    assert not rr.keeps_row_in_registers(_features(16384, 2048, _full(*"abcdefghi")), False)
    # rows longer than MAX_ROW, even with one input
    assert not rr.keeps_row_in_registers(_features(16384, rr.MAX_ROW + 1, _full("x")), False)


def test_buffers_produced_in_the_kernel_are_not_inputs():
    feats = _features(16384, 5632, _full("x1", "x3", "tmp"), writes=("tmp",))
    assert rr.row_inputs(feats) == 2
    assert rr.keeps_row_in_registers(feats, False)


def test_other_reductions_keep_inductors_choice():
    two = _full("x1", "x3")
    # a split reduction (sum |W| of a weight in 512 chunks)
    assert not rr.keeps_row_in_registers(_features(512, 8192, _full("w")), False)
    assert not rr.keeps_row_in_registers(_features(16384, 5632, two, hint=ReductionHint.OUTER), False)
    assert not rr.keeps_row_in_registers(_features(16384, 5632, two), True)  # cooperative
    # sizes that are not static (dynamic shapes)
    s = sympy.Symbol("s0", integer=True, positive=True)
    assert not rr.keeps_row_in_registers(_features(s, 5632, two), False)
    assert not rr.keeps_row_in_registers(_features(16384, s, two), False)
    with inductor_config.patch({"triton.persistent_reductions": False}):
        assert not rr.keeps_row_in_registers(_features(16384, 5632, two), False)


@pytest.fixture
def inductor_choices():
    """Inductor's choices config and this thread's choices object, restored afterwards."""
    with inductor_config.patch(inductor_choices_class=None), V.set_choices_handler(InductorChoices()):
        yield


def test_install_sets_inductors_choices_once_and_leaves_anothers(inductor_choices, caplog):
    # this thread already holds Inductor's default choices (built by an earlier compile)
    assert type(V.choices) is InductorChoices
    assert rr.install()
    assert inductor_config.inductor_choices_class is rr.PersistentRowReductions
    assert type(V.choices) is rr.PersistentRowReductions
    assert rr.install()
    assert inductor_config.inductor_choices_class is rr.PersistentRowReductions

    class Theirs(InductorChoices):
        pass

    with inductor_config.patch(inductor_choices_class=Theirs), caplog.at_level(logging.WARNING):
        assert not rr.install()
        assert inductor_config.inductor_choices_class is Theirs
    assert "bitnet_persistent_rows" in caplog.text


@pytest.mark.parametrize("compile_on,option,installed", [
    (True, True, True), (True, False, False), (False, True, False)])
def test_converter_installs_the_choices_under_compile(inductor_choices, compile_on, option,
                                                      installed):
    job = SimpleNamespace(lowbit=LowBit(bitnet_persistent_rows=option),
                          compile=SimpleNamespace(enable=compile_on, components=["model"]))
    CONVERTERS["bitnet"](job, SimpleNamespace(tp_enabled=False))
    assert (inductor_config.inductor_choices_class is rr.PersistentRowReductions) == installed
    assert (type(V.choices) is rr.PersistentRowReductions) == installed


def _swiglu_quantize(x1, x3):
    return bq.quantize_rows_reference(torch.nn.functional.silu(x1) * x3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor's Triton kernels need a GPU")
def test_compiled_row_quantization_is_one_persistent_kernel_with_the_same_values():
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator(device="cuda").manual_seed(0)
    x1, x3 = (torch.randn(4096, 5632, device="cuda", generator=gen).bfloat16() for _ in range(2))
    results, codes = {}, {}
    for name, choices in (("default", InductorChoices), ("rows", rr.PersistentRowReductions)):
        torch._dynamo.reset()
        with inductor_config.patch(fx_graph_cache=False), V.set_choices_handler(choices()):
            fn = torch.compile(_swiglu_quantize, fullgraph=True)
            results[name], code = run_and_get_code(fn, x1, x3)
        codes[name] = "\n".join(code)
    torch._dynamo.reset()
    assert "triton_red_" in codes["default"] and "triton_per_" not in codes["default"]
    assert "triton_per_" in codes["rows"] and "triton_red_" not in codes["rows"]
    for a, b in zip(results["default"], results["rows"]):
        assert torch.equal(a, b)
    q, s = results["rows"]
    assert q.dtype == torch.int8 and q.abs().max() == 127
