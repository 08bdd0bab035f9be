"""Fused low-bit AdamW kernel vs its PyTorch reference, and the quantization maps.

On a machine without a GPU the kernel runs under ``TRITON_INTERPRET=1`` and must match the
reference bit for bit (same fp32 ops in the same order). On a GPU the compiled kernel may fuse
multiply-adds, so values are compared to tight tolerances and codes may differ by one step
at a handful of rounding boundaries.
"""

import os
import subprocess
import sys

import pytest
import torch

from conftest import INTERPRET
from titan_lowbit.kernels import adamw_lowbit as K
from titan_lowbit.kernels import adamw_lowbit_ref as R
from titan_lowbit.kernels import optim_jit as J
from titan_lowbit.kernels import quant_maps as Q
from titan_lowbit.kernels.private_apis import private_api_ok

from adamw_kernel_cases import (CUDA, DEV, FORMATS, SHAPES, assert_matches_reference, clone_tensor,
                                make_tensor, step_against_reference)


def test_every_kernel_runs_as_the_session_chose():
    """conftest.py chooses once whether the interpreter runs the kernels: every kernel
    module, whichever test file imported it first, and a kernel defined in a test agree
    (an interpreted kernel cannot call a compiled one, nor the other way round)."""
    import triton

    from titan_lowbit.kernels import bitnet_matmul, bitnet_quant

    @triton.jit
    def defined_here():
        pass

    kinds = {name: type(fn).__name__ for name, fn in (
        ("adamw_lowbit", K._adamw_lowbit_kernel), ("bitnet_quant", bitnet_quant._quantize_rows_kernel),
        ("bitnet_matmul", bitnet_matmul._int8_matmul_kernel.fn), ("this test", defined_here))}
    want = "InterpretedFunction" if INTERPRET else "JITFunction"
    assert set(kinds.values()) == {want}, kinds
    assert K.interpreting() == INTERPRET and bitnet_matmul.INTERPRET == INTERPRET


def test_loops_with_run_time_bounds_iterate_as_range():
    """kernels/loops.py: compiled, the kernels' loops are tl.range (the loop Python's
    range gives); interpreted, a generator with range's iterations (ints here; the
    interpreter's one-element scalars in a kernel, where the kernel tests cover it)."""
    import triton.language as tl

    from titan_lowbit.kernels import bitnet_matmul, bitnet_quant, loops

    iterate = loops.kernel_range()
    assert (iterate is tl.range) == (not INTERPRET)
    assert K._range is bitnet_quant._range is bitnet_matmul._range is iterate
    for args in ((0,), (5,), (0, 5), (3, 10, 4), (2, 2), (7, 3), (1, 130, 32)):
        assert list(loops._interpreted_range(*args, flatten=True)) == list(range(*args)), args

def test_launch_passes_arguments_in_the_kernels_order(monkeypatch):
    """FusedAdamW.launch passes every argument positionally (the direct launch of a
    compiled kernel takes them so): the launch's argument list must name the kernel's
    parameters in order. Checked by recording what a launch passes."""
    import inspect

    names = list(inspect.signature(K._adamw_lowbit_kernel.fn).parameters)
    mc, vc, block = FORMATS["8bit"]
    cfg = K.AdamWConfig(mc, vc, False, block, K.UPDATE_KAHAN, False, torch.bfloat16, torch.bfloat16)
    ts = [make_tensor(cfg, (3, 300), torch.Generator().manual_seed(0))]
    plan = K.FusedAdamW(cfg, ts, elems_per_program=512, num_warps=4)
    plan.point_at([torch.zeros_like(ts[0].param)])
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(args)

    interpreted = K.interpreting()
    monkeypatch.setattr(K, "interpreting", lambda: interpreted)  # it looks at the kernel's type
    monkeypatch.setattr(K, "_adamw_lowbit_kernel", Recorder())
    try:
        plan.launch(K.AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0, step=3))
    except AttributeError:  # on a GPU the shared-memory check reads the recorder's (absent) metadata
        pass
    (args,) = seen
    assert len(args) == len(names)
    bound = dict(zip(names, args))
    assert (bound["M_CODEC"], bound["V_CODEC"], bound["UPDATE"], bound["DECOUPLED"], bound["QBLOCK"],
            bound["NB"]) == (mc, vc, K.UPDATE_KAHAN, False, block, plan.nb)
    assert bound["g_base"] is plan._grad_base and bound["tiles_ptr"] is plan.tiles
    assert bound["SMEM_WORDS"] == plan.smem[2] and bound["HW_CAST"] == (not K.interpreting())
    assert isinstance(bound["wd"], float) and bound["skey"] == Q.step_key(3)


def test_launch_cache_follows_what_triton_specializes_on():
    """After its first launch a plan launches the kernel Triton compiled for it directly;
    an lr tensor of another dtype, a gradient base of another alignment or an int
    hyperparameter must not reuse a kernel compiled for something else (on a GPU an fp32
    kernel reading an fp64 lr, or an i32 weight decay, gives wrong updates). Every step
    is compared with the reference."""
    fmt = "8bit"
    mc, vc, block = FORMATS[fmt]
    cfg = K.AdamWConfig(mc, vc, False, block, K.UPDATE_STOCHASTIC, True, torch.bfloat16, torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    ts = [make_tensor(cfg, s, gen) for s in SHAPES]
    ref = [clone_tensor(t) for t in ts]
    numel = [t.param.numel() for t in ts]
    plan = K.FusedAdamW(cfg, ts, elems_per_program=512, num_warps=4)
    assert not plan.aligned  # ragged rows: any gradient alignment joins this plan
    flat = torch.empty(sum(numel) + 64, dtype=torch.bfloat16, device=DEV)
    steps = [  # (gradient offset in elements, lr, weight decay)
        (0, 3e-3, 0),
        (1, torch.tensor(2e-3, device=DEV), 0.1),
        (1, torch.tensor(2e-3, dtype=torch.float64, device=DEV), 0.1),
        (8, torch.tensor(1e-3, dtype=torch.bfloat16, device=DEV), 0),
        (0, 3e-3, 0.1),
    ]
    keys = set()
    # compiled kernels are cached where Triton's private launch API may be used; with
    # TITAN_LOWBIT_PRIVATE_APIS=0 every step goes through Triton's own launch
    cached = CUDA and private_api_ok("triton")
    for step, (off, lr, wd) in enumerate(steps, start=1):
        flat.copy_(torch.randn(flat.shape, generator=gen).to(torch.bfloat16))  # fresh values every step
        grads, at = [], off
        for t, n in zip(ts, numel):
            grads.append(flat[at:at + n].view(t.param.shape))
            at += n
        hyper = K.AdamWHyper(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=wd, step=step)
        assert plan.step(grads, hyper)
        R.adamw_step_reference(cfg, ref, [g.clone() for g in grads], hyper)
        assert_matches_reference(cfg, ts, ref, f"step {step} (offset {off}, lr {lr!r}, wd {wd!r})")
        if cached:
            keys.add(plan._compiled[0])
    if cached:  # fp32 / fp64 / bf16 lr tensors, the tables' pointer as the float lr's stand-in
        assert len(keys) >= 4, keys


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kernel_matches_reference_fp32_params(fmt):
    step_against_reference(fmt, torch.float32, K.UPDATE_NEAREST)


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "bf16"])
@pytest.mark.parametrize("update", ["nearest", "stochastic", "kahan", "master"])
def test_kernel_matches_reference_bf16_params(fmt, update):
    step_against_reference(fmt, torch.bfloat16, K.WEIGHT_UPDATES[update], seed=1)


@pytest.mark.parametrize("fmt,update", [("8bit", "stochastic"), ("4bit", "kahan"), ("fp8", "master"),
                                        ("bf16", "nearest")])
@pytest.mark.parametrize("tiles", [1, 3, 5])
def test_kernel_matches_reference_for_any_tiles_per_program(fmt, update, tiles):
    """A program steps several tiles in order: the same result for any number of tiles per
    program, where the last program holds fewer tiles than the others (the table's tile
    count is not a multiple of 3 or 5 here) and the tiles of one program span tensors."""
    step_against_reference(fmt, torch.bfloat16, K.WEIGHT_UPDATES[update], seed=7, elems=256, tiles=tiles)


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_kernel_matches_reference_across_twenty_decades(fmt):
    """States and gradients spread over 1e-20..1 within a block: normalized values fall in
    every encode bucket, below the kernel's shared-memory bucket window (2**-31) too."""
    step_against_reference(fmt, torch.float32, K.UPDATE_NEAREST, seed=3, spread=20.0)


@pytest.mark.parametrize("fmt,pdtype,update", [
    ("8bit", torch.float32, "nearest"), ("4bit", torch.bfloat16, "kahan"), ("fp8", torch.bfloat16, "master"),
    ("fp32", torch.bfloat16, "stochastic"), ("bf16", torch.float32, "nearest"), ("8bit", torch.bfloat16, "stochastic"),
])
def test_nonfinite_guard_leaves_poisoned_blocks_and_flags_their_tensors(fmt, pdtype, update):
    """nonfinite_grad="raise": a block whose gradient holds a nan, inf or -inf is not
    written (weight, moments, absmax, extra state), the rest of its tensor and every other
    tensor step as the reference does, and the flags of exactly the poisoned tensors get
    the step's tag; ragged shapes (masked launch) and whole tiles only (unmasked loads)."""
    step_against_reference(fmt, pdtype, K.WEIGHT_UPDATES[update], seed=5, guard=True)
    step_against_reference(fmt, pdtype, K.WEIGHT_UPDATES[update], seed=6, guard=True, shapes=[(4, 512), (2, 1024), (8, 256)])


@pytest.mark.skipif(not CUDA, reason="registers and spills of the compiled kernel")
@pytest.mark.parametrize("fmt,pdtype,update", [
    ("8bit", torch.bfloat16, "stochastic"), ("4bit", torch.bfloat16, "stochastic"), ("fp8", torch.bfloat16, "stochastic"),
    ("8bit", torch.bfloat16, "master"), ("8bit", torch.float32, "nearest"), ("bf16", torch.bfloat16, "kahan"),
])
def test_guarded_kernel_fits_its_register_cap_without_spills(fmt, pdtype, update):
    """The guard's register cap (GUARD_MAXNREG) must not make the compiler spill."""
    if not private_api_ok("triton"):
        pytest.skip("the compiled kernel is read from the launch cache, which Triton's private "
                    "launch API fills (TITAN_LOWBIT_PRIVATE_APIS=0 turns it off)")
    mc, vc, block = FORMATS[fmt]
    cfg = K.AdamWConfig(mc, vc, fmt == "bf16", block, K.WEIGHT_UPDATES[update], True, pdtype, pdtype)
    gen = torch.Generator().manual_seed(0)
    ts = [make_tensor(cfg, (64, 1024), gen)]
    grads = [torch.randn(64, 1024, generator=gen).to(pdtype).to(DEV)]
    plan = K.FusedAdamW(cfg, ts)
    guard = K.NonfiniteGuard(torch.zeros(1, dtype=torch.int32, device=DEV), 1)
    plan.step(grads, K.AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1), guard)
    kernel = plan._compiled[1]
    kernel._init_handles()
    assert kernel.n_regs <= K.GUARD_MAXNREG and kernel.n_spills == 0, (kernel.n_regs, kernel.n_spills)


def test_kernel_matches_reference_adam_l2_lr_tensor_mixed_grads():
    step_against_reference("8bit", torch.bfloat16, K.UPDATE_STOCHASTIC, decoupled=False, lr_tensor=True,
         grad_dtype=torch.float32, seed=2, elems=256)
    step_against_reference("4bit", torch.float32, K.UPDATE_NEAREST, decoupled=False, lr_tensor=True, seed=3, elems=2048)


def test_stochastic_rounding_bits_identical_and_unbiased():
    """Same (key, step, index) -> same bits in kernel and reference; E[SR(x)] = x."""
    n = 4096
    gidx = torch.arange(n, dtype=torch.int64) + 2**33 - 100  # crosses the 2**32 boundary
    x = torch.full((n,), 1.0 + 2.0**-10)  # bf16 neighbours 1.0 and 1.0078125: p(up) = 1/8
    out = R.bf16_stochastic(x, gidx, 1234, Q.step_key(7)).float()
    frac_up = (out > 1.0).float().mean().item()
    assert abs(frac_up - 0.125) < 0.02, frac_up
    assert set(out.unique().tolist()) == {1.0, 1.0078125}
    # A different step gives different bits; the same step the same bits.
    again = R.bf16_stochastic(x, gidx, 1234, Q.step_key(7)).float()
    other = R.bf16_stochastic(x, gidx, 1234, Q.step_key(8)).float()
    assert torch.equal(out, again) and not torch.equal(out, other)
    # Kernel vs reference on the same random update (bit for bit under the interpreter).
    step_against_reference("bf16", torch.bfloat16, K.UPDATE_STOCHASTIC, seed=4)


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_stochastic_rounding_of_tensors_stored_with_their_global_rows(fmt):
    """The kernel's SR_DENSE path (every tensor's global row stride is its local row length,
    as for unsharded and Shard(0) parameters: the global index is the local offset plus a
    base) gives what the general row * stride + column path and the reference give."""
    step_against_reference(fmt, torch.bfloat16, K.UPDATE_STOCHASTIC, seed=6, sr_dense=True)


@pytest.mark.parametrize("sr_dense", [False, True])
def test_stochastic_rounding_with_32_bit_global_indices(sr_dense):
    """When every global index of a launch is below 2**32 the kernel hashes a uint32 index
    (SR_IDX32): the same bits as the 64-bit formula, up to the last index 2**32 - 1."""
    step_against_reference("8bit", torch.bfloat16, K.UPDATE_STOCHASTIC, seed=7, sr_dense=sr_dense, sr_below_2_32=True)


@pytest.mark.parametrize("idx32", [True, False])
def test_stochastic_rounding_of_special_values(idx32):
    """NaNs (including the all-ones patterns whose sum with the random bits would carry into
    the sign bit) stay NaN, infinities stay infinite, a finite value lands on one of its two
    bf16 neighbours (bf16's largest value may round up to inf); the kernel's bits equal the
    reference's on every pattern, finite or not."""
    import triton
    import triton.language as tl

    @triton.jit
    def sr_kernel(x_ptr, out_ptr, gbase, key, N: tl.constexpr, IDX32: tl.constexpr):
        offs = tl.arange(0, N)
        gidx = (gbase + offs).to(tl.uint32) if IDX32 else gbase + offs.to(tl.int64)
        out = J._bf16_stochastic(tl.load(x_ptr + offs), gidx, key.to(tl.uint32), IDX32)
        tl.store(out_ptr + offs, out)

    gen = torch.Generator().manual_seed(11)
    # NaNs (all ones; -1 is the negative one; signalling; quiet; negative quiet), +-inf,
    # bf16's largest value and -it, zeros, the smallest denormal, a low-half-only pattern
    special = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000, -0x400000, 0x7F800000, -0x800000,
                            0x7F7FFFFF, -0x00800001, 0, -(2**31), 1, 0x7FFF], dtype=torch.int64)
    n = 512
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
    bits[: special.numel()] = special
    x = bits.to(torch.int32).view(torch.float32)
    gbase = 2**32 - n if idx32 else 2**33 - 100  # idx32: the last index is 2**32 - 1
    key = int(torch.randint(0, 2**31, (1,), generator=gen))
    out = torch.empty(n, dtype=torch.bfloat16, device=DEV)
    sr_kernel[(1,)](x.to(DEV), out, gbase, key, N=n, IDX32=idx32)
    gidx = torch.arange(n, dtype=torch.int64) + gbase
    want = R.bf16_stochastic(x, gidx, key, 0)
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
    got = want.float()
    nan = torch.isnan(x)
    assert torch.isnan(got[nan]).all() and not torch.isnan(got[~nan]).any()
    inf = torch.isinf(x)
    assert torch.equal(got[inf], x[inf])
    fin = ~nan & ~inf
    down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # truncated: one neighbour
    up = (down.view(torch.int32) + 0x10000).view(torch.float32)  # the other, away from 0 (may be inf)
    assert ((got[fin] == down[fin]) | (got[fin] == up[fin])).all()


def test_hash_matches_host_definition():
    h = torch.tensor([0, 1, 2**31, 2**32 - 1, 123456789], dtype=torch.int64)
    assert R.mix32(h).tolist() == [Q.mix32(int(v)) for v in h]


@pytest.mark.parametrize("codec", [Q.CODEC_DYN8_SIGNED, Q.CODEC_DYN8_UNSIGNED, Q.CODEC_DYN4_SIGNED,
                                   Q.CODEC_LIN4_NOZERO, Q.CODEC_FP8_E4M3])
def test_codec_is_nearest_code(codec):
    """encode() returns the nearest entry of the code book (the second moment's 8-bit map: a
    positive value nearest to 0 gets the smallest positive code); decode() returns that entry."""
    book = Q.code_book(codec)
    codes = torch.arange(book.numel(), dtype=torch.int32)
    valid = book.isfinite()  # e4m3's two NaN codes are never produced
    torch.testing.assert_close(R.decode(codes, codec).double()[valid], book[valid], rtol=2e-7, atol=0)
    book = torch.where(valid, book, torch.full_like(book, 1e9))
    gen = torch.Generator().manual_seed(codec)
    signed = codec not in (Q.CODEC_DYN8_UNSIGNED, Q.CODEC_LIN4_NOZERO)
    x = torch.rand(20000, generator=gen) ** 6  # many small values: exercise every decade
    x = torch.cat([x, book.float().abs(), torch.tensor([0.0, 1.0])])
    if signed:
        x = x * torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0)
    if codec == Q.CODEC_DYN8_UNSIGNED:  # the second moment's map is zero-free (quant_maps.py)
        x = torch.cat([x, torch.tensor([1e-45, 1e-30, 1e-9, 4.9e-8, 5e-8])])
        low = (x > 0) & (x.double() <= book[1] / 2)
        assert torch.all(book[R.encode(x[low], codec).long()] == book[1]) and int(R.encode(x[x == 0], codec).max()) == 0
        x = x[~low]
    got = book[R.encode(x, codec).long()]
    dist = (book[None, :] - x.double()[:, None]).abs()
    best = dist.min(dim=1).values
    err = (got - x.double()).abs()
    assert torch.all(err <= best * (1 + 1e-5) + 1e-12), (err - best).max()


def test_fp8_codec_matches_torch_cast():
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(50000, generator=gen) * 2 - 1) * torch.logspace(0, -6, 50000)
    codes = R.encode(x, Q.CODEC_FP8_E4M3).to(torch.uint8)
    want = (x * 448.0).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(codes, want)


def test_bf16_rne_matches_torch_cast():
    x = torch.randn(100000) * torch.logspace(-30, 30, 100000)
    assert torch.equal(R.bf16_rne(x).view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("codec,block", [(Q.CODEC_DYN8_SIGNED, 256), (Q.CODEC_DYN4_SIGNED, 128),
                                         (Q.CODEC_LIN4_NOZERO, 128), (Q.CODEC_FP8_E4M3, 128)])
def test_blockwise_layout_rows_and_padding(codec, block):
    """Blocks never span rows; scales are [rows, ceil(cols / block)]; odd rows are padded."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2 * block + 5, generator=gen)
    if codec == Q.CODEC_LIN4_NOZERO:
        x = x.abs()
    x[1] *= 1000.0  # a loud row must not change its neighbours' scales
    codes, absmax = R.quantize_blockwise(x, codec, block)
    assert absmax.shape == (3, 3)
    want_cols = (x.shape[1] + 1) // 2 if codec in Q.PACKED_4BIT_CODECS else x.shape[1]
    assert codes.shape == (3, want_cols) and codes.dtype == torch.uint8
    for r in range(3):
        for b in range(3):
            seg = x[r, b * block:(b + 1) * block]
            assert absmax[r, b] == seg.abs().max()
    back = R.dequantize_blockwise(codes, absmax, codec, block, x.shape[1])
    rel = ((back - x).abs() / absmax.repeat_interleave(block, 1)[:, : x.shape[1]]).max()
    assert rel < {Q.CODEC_DYN8_SIGNED: 0.02, Q.CODEC_DYN4_SIGNED: 0.2, Q.CODEC_LIN4_NOZERO: 0.07,
                  Q.CODEC_FP8_E4M3: 0.07}[codec]
    if codec in Q.PACKED_4BIT_CODECS:
        zero_code = int(R.encode(torch.zeros(1), codec))
        assert torch.all((codes[:, -1] >> 4) == zero_code)  # the pad nibble


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
@pytest.mark.parametrize("tile_elems", [512, 1024, 2048])
def test_shared_memory_image_holds_the_tables_where_the_kernel_reads_them(fmt, tile_elems):
    """On the GPU the kernel reads its code tables from shared memory (``_lookup`` with
    SMEM >= 0): a codec's value of magnitude p at its offset + 4p, midpoint p at offset +
    4 * 2**M + 4p, encode bucket i at offset + 8 * 2**M + i (bytes; the 4-bit map's as
    int32 words at + 4i). The image ``_smem_tables_store`` copies there must hold the
    same entries as the tables the interpreter's tl.gather and the reference read, past
    the gap left to Triton's own scratch, inside the image, without overlaps."""
    from titan_lowbit.optim.formats import STATE_FORMATS
    f = STATE_FORMATS[fmt]
    m_off, v_off, words = K.smem_layout(f.m_codec, f.v_codec, tile_elems)
    image = K.smem_image(f.m_codec, f.v_codec, tile_elems, "cpu").view(torch.uint8)
    assert image.numel() == 4 * words and words & (words - 1) == 0
    tables, enc = Q.codec_tables("cpu"), Q.encode_tables("cpu")
    spans = []
    for codec, off in ((f.m_codec, m_off), (f.v_codec, v_off)):
        if codec not in Q.DYN_MAGNITUDE_BITS:
            assert off == -1
            continue
        nmag, window = 1 << Q.DYN_MAGNITUDE_BITS[codec], Q.ENC_WINDOW[codec]
        words_at = lambda start, n: image[start:start + 4 * n].view(torch.int32)  # noqa: E731
        assert torch.equal(words_at(off, nmag).view(torch.float32), tables[codec, Q.TABLE_LUT:Q.TABLE_LUT + nmag])
        assert torch.equal(words_at(off + 4 * nmag, nmag).view(torch.float32),
                           tables[codec, Q.TABLE_MID:Q.TABLE_MID + nmag])
        low = Q.enc_size(codec) - window
        want = enc[codec, low:low + window]
        if K.enc_window_entry_bytes(codec) == 4:  # int32 words
            got, end = words_at(off + 8 * nmag, window), off + 8 * nmag + 4 * window
            assert torch.equal(got, want.to(torch.int32))
        else:
            got, end = image[off + 8 * nmag:off + 8 * nmag + window], off + 8 * nmag + window
            assert torch.equal(got, want)
        spans.append((off, end))
    spans.sort()
    assert spans and spans[0][0] >= K.smem_gap(tile_elems) and spans[-1][1] <= 4 * words
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert not image[:K.smem_gap(tile_elems)].any()  # the gap holds no table


@pytest.mark.parametrize("private_apis", ["1", "0"])
def test_shared_memory_tables_only_with_a_tested_triton(private_apis, monkeypatch):
    """The tables in shared memory rely on how Triton lays it out (kernels/private_apis.py):
    a compiled plan keeps them there with a tested Triton; with the private APIs off (or an
    untested Triton) tl.gather reads them, as under the interpreter."""
    from titan_lowbit.kernels import private_apis as fence

    monkeypatch.setattr(K, "interpreting", lambda: False)  # the plan a compiled kernel gets
    monkeypatch.setattr(fence, "_told", set())
    monkeypatch.setenv(fence.ENV, private_apis)
    mc, vc, block = FORMATS["8bit"]
    cfg = K.AdamWConfig(mc, vc, False, block, K.UPDATE_NEAREST, True, torch.float32, torch.float32)
    plan = K.FusedAdamW(cfg, [make_tensor(cfg, (4, 512), torch.Generator().manual_seed(0))], elems_per_program=512)
    if private_apis == "1":
        assert plan.smem == K.smem_layout(mc, vc, 512) and plan.smem[2] > 0
    else:
        assert plan.smem == (-1, -1, 0) and plan.smem_image is plan.tables


def test_triton_scratch_stays_below_the_shared_memory_tables():
    """The tables live in shared memory for a program's life, but Triton does not know
    they are there: its own scratch (layout conversions in the tile loop) must stay inside
    the gap below them, or it would overwrite them between reads. Compiles every family
    for sm_90 (no GPU needed) with the installed triton and checks."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "sass_count.py")
    proc = subprocess.run([sys.executable, script, "--check-scratch"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OVERLAPS" not in proc.stdout and proc.stdout.count("\n") > 40


def test_optimizer_launch_plans_match_reference_path():
    """The optimizer's fused path (launch plans: families split into aligned/unaligned and
    whole-tile/ragged variants, cached tables, gradients re-uploaded when they move) gives
    the same bits as its reference path. Runs the kernel under the interpreter on CPU."""
    from titan_lowbit.optim import adamw as A
    from titan_lowbit.optim.tensors import local

    shapes = [(64, 256), (33, 300), (4096,), (2, 3, 1024), (17,), (8, 512)]
    if INTERPRET:  # the same plans (whole-tile, ragged, small fp32), fewer tiles to interpret
        shapes = [(16, 256), (5, 300), (4096,), (2, 3, 512), (17,), (8, 512)]
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
    pf = [torch.nn.Parameter(b.clone().to(DEV)) for b in base]
    pr = [torch.nn.Parameter(b.clone().to(DEV)) for b in base]
    kw = dict(lr=1e-2, weight_decay=0.1, state_format="8bit", weight_update="stochastic", min_quantized_numel=1000)
    fused = A.LowBitAdamW(pf, **kw)
    ref = A.LowBitAdamW(pr, **kw)
    fused._use_fused = lambda t: True
    ref._use_fused = lambda t: False
    for step in range(3):
        for a, b in zip(pf, pr):
            g = torch.randn(a.shape, generator=gen).to(torch.bfloat16).to(DEV)
            a.grad, b.grad = g.clone(), g.clone()  # fresh gradient storage every step
        if step == 2:  # new parameter storage: the cached launch tables must not write to the old
            pf[0].data = pf[0].data.clone()
        fused.step()
        ref.step()
    plans = [pl for launches, _ in fused._plans.values() for pl, _ in launches]
    assert len(fused._plans) == 2  # two families: 8-bit matrices, fp32-state small tensors
    assert {(pl.aligned, pl.even) for pl in plans} >= {(True, True), (False, False)}
    assert sum(len(pl.tensors) for pl in plans) == len(shapes)
    for a, b in zip(pf, pr):
        if CUDA:
            torch.testing.assert_close(a.float(), b.float(), rtol=8e-3, atol=1e-5)
        else:
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
            for key, val in ref.state[b].items():
                assert torch.equal(fused.state[a][key], val), key


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_fused_path_nonfinite_gradient_changes_nothing(policy):
    """skip: the fused path prepares its launches before the non-finite check's sync; a
    NaN gradient must still leave every weight, state and step count as it was. raise:
    the fused step leaves the NaN's block alone like the reference path, and the next step
    raises naming the parameter before it changes anything. Then a finite step equals the
    reference's."""
    from titan_lowbit.optim import adamw as A
    from titan_lowbit.optim.tensors import local

    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(s, generator=gen) for s in [(16, 256), (300,), (8, 512)]]
    pf = [torch.nn.Parameter(b.clone().to(DEV)) for b in base]
    pr = [torch.nn.Parameter(b.clone().to(DEV)) for b in base]
    kw = dict(lr=1e-2, state_format="4bit", min_quantized_numel=1000, nonfinite_grad=policy)
    fused = A.LowBitAdamW([(f"w{i}", p) for i, p in enumerate(pf)], **kw)
    ref = A.LowBitAdamW([(f"w{i}", p) for i, p in enumerate(pr)], **kw)
    fused._use_fused = lambda t: True
    ref._use_fused = lambda t: False

    def grads(bad):
        gs = [torch.randn(b.shape, generator=gen).to(DEV) for b in base]
        if bad:
            gs[2][3, 7] = float("nan")
        for a, b, g in zip(pf, pr, gs):
            a.grad, b.grad = g.clone(), g.clone()

    grads(False)
    fused.step()
    ref.step()
    before = [p.detach().clone() for p in pf]
    state = {k: v.clone() for k, v in fused.state[pf[0]].items()}
    grads(True)
    if policy == "raise":
        before_r = pr[2].detach().clone()
        fused.step()
        ref.step()
        assert torch.equal(pf[2][3, :128], before[2][3, :128]) and not torch.equal(pf[2], before[2])
        assert torch.equal(pr[2][3, :128], before_r[3, :128]) and not torch.equal(pr[2], before_r)
        before = [p.detach().clone() for p in pf]
        state = {k: v.clone() for k, v in fused.state[pf[0]].items()}
        grads(False)
        for opt in (fused, ref):
            with pytest.raises(FloatingPointError, match="'w2' at optimizer step 2"):
                opt.step()
    else:
        fused.step()
        assert fused.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(pf, before))
    assert all(torch.equal(fused.state[pf[0]][k], v) for k, v in state.items())
    grads(False)
    fused.step()
    ref.step()
    for a, b in zip(pf, pr):
        if CUDA:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b)


def test_fused_path_updates_bitnet_weights_in_place():
    """BitNet's training weight is a wrapper subclass whose own data_ptr() is 0: the fused
    kernels must update its inner tensor, giving the same bits as the reference path."""
    from titan_lowbit.bitnet import convert_to_bitnet
    from titan_lowbit.optim import adamw as A
    from titan_lowbit.optim.tensors import local

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32)).to(DEV)
        convert_to_bitnet(m, filter_fqns=[])
        return m

    mf, mr = model(), model()
    kw = dict(lr=1e-2, state_format="8bit", min_quantized_numel=0)
    fused = A.LowBitAdamW(list(mf.named_parameters()), **kw)
    ref = A.LowBitAdamW(list(mr.named_parameters()), **kw)
    fused._use_fused = lambda t: True
    ref._use_fused = lambda t: False
    x = torch.randn(16, 64, device=DEV)
    before = local(mf[0].weight).clone()
    for m, opt in ((mf, fused), (mr, ref)):
        m(x).square().mean().backward()
        opt.step()
    assert not torch.equal(local(mf[0].weight), before)
    for (name, a), b in zip(mf.named_parameters(), mr.parameters()):
        if CUDA:
            torch.testing.assert_close(local(a), local(b), rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(local(a), local(b)), name
