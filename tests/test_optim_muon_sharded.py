"""LowBitMuon on sharded parameters (gloo, CPU): FSDP2 on 2 processes, FSDP2 x TP and
HSDP on 4, each against one process holding the whole parameters.

One run per process count (conftest.run_on_gloo) runs every scenario; rank 0's results
go to the tests below:
* states are DTensors placed like their parameters, in the whole matrix's block layout;
* sharded steps give the same bits as unsharded ones (weights and states), for fp32,
  8-bit and 4-bit momentum and bf16 weight updates (stochastic rounding included), with
  the Muon matrices orthogonalised by their owner ranks and the AdamW part beside them;
* so do the fused kernels (interpreted) on the shards, against the reference unsharded;
* the exchange sends what it says (bf16, the non-owners' shards both ways);
* a DCP checkpoint (get/set_optimizer_state_dict) resumes bit for bit on 2 processes and
  loads on 1 process (here, in the test process) equal to the unsharded optimizer's state;
* a non-finite gradient in one rank's shard stops (or skips) the step on every rank;
* a factor beside a 4-bit momentum on row shards (FSDP2, HSDP): the owner makes the new
  factor from the whole new momentum, every rank gets its rows; equal to unsharded bit for
  bit on both paths, and its DCP checkpoint resumes bit for bit; with a matrix's columns
  split (tensor parallel) it is refused naming the option;
* a TP shard that would split a quantization block is refused naming the parameter;
* the exchange alone (4 processes): a side matrix travels with the input to the owner and
  the owner's extra results, indexed by rows or by columns, come back to every rank as its
  slices, bit for bit, over rows, columns (2 and 3 ranks), FSDP2 x TP and HSDP.
"""

import functools

import pytest
import torch
import torch.nn as nn

from conftest import run_on_gloo, train_mean_square

# (state format, parameter dtype, bf16 weight update); the first is also the DCP case.
CASES = [("8bit", torch.bfloat16, "stochastic"), ("fp32", torch.float32, "nearest"),
         ("4bit", torch.bfloat16, "master_remainder"), ("fp8", torch.bfloat16, "kahan")]
# Biases and the norm (sharded 1-D: FSDP2 splits their blocks) keep fp32 AdamW states.
KW = dict(lr=2e-2, weight_decay=0.1, min_quantized_numel=1000, seed=5)
SAVE_AFTER = 2  # steps before the DCP checkpoint; as many follow it


def muon_model(dtype=torch.bfloat16):
    """Three Muon matrices (0, 2 and 3's weights: wide, tall, wide) and AdamW parameters
    (biases, the norm). 37 rows split 19 + 18 over 2 ranks; 300 columns end 8-bit's
    blocks of 256 with a short one."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(300, 37), nn.LayerNorm(37), nn.Linear(37, 70, bias=False),
                         nn.Linear(70, 16)).to(dtype)


def inputs(n, dtype, width=300):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(4, width, generator=gen).to(dtype) for _ in range(n)]


def full(t):
    """The whole tensor; fp8 as its bytes (gloo gathers neither fp8 nor int16: fp8 travels
    as bytes, int16 as int32)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        loc, dtype = t._local_tensor, t.dtype
        carrier = {torch.float8_e4m3fn: loc.view(torch.uint8), torch.int16: loc.to(torch.int32)}.get(dtype, loc)
        t = DTensor.from_local(carrier, t.device_mesh, t.placements, shape=t.shape, stride=t.stride()).full_tensor()
        t = t.to(torch.int16) if dtype == torch.int16 else t
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def same(model, opt, ref, ref_opt):
    """Whether weights and every state entry equal the unsharded run's, bit for bit."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if not torch.equal(full(p.detach()), q.detach()):
            return f"weight {name}"
        for k, v in ref_opt.state[q].items():
            if not torch.equal(full(opt.state[p][k]), full(v)):
                return f"state {name}.{k}"
    return True


def fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for mod in model:
        if isinstance(mod, nn.Linear):
            fully_shard(mod, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _two_processes(rank, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from titan_lowbit.optim import LowBitMuon

    mesh = init_device_mesh("cpu", (2,))
    res = {"equal": {}, "equal_fused": {}}
    for fmt, dtype, update in CASES:
        kw = dict(KW, state_format=fmt, weight_update=update)
        xs = inputs(2 * SAVE_AFTER, dtype)
        ref, sh = muon_model(dtype), fsdp(muon_model(dtype), mesh)
        ref_opt = LowBitMuon(ref.named_parameters(), **kw)
        opt = LowBitMuon(sh.named_parameters(), **kw)
        if fmt == CASES[0][0]:
            res["placements"] = {name: (str(p.placements), {k: (type(v).__name__, str(getattr(v, "placements", None)),
                                                                tuple(v.shape), tuple(v._local_tensor.shape))
                                                            for k, v in opt.state[p].items() if k != "step"})
                                 for name, p in sh.named_parameters()}
        train_mean_square(ref, ref_opt, xs[:SAVE_AFTER])
        train_mean_square(sh, opt, xs[:SAVE_AFTER])
        if fmt != CASES[0][0]:
            train_mean_square(ref, ref_opt, xs[SAVE_AFTER:])
            train_mean_square(sh, opt, xs[SAVE_AFTER:])
            res["equal"][(fmt, update)] = same(sh, opt, ref, ref_opt)
            continue
        # What the exchange sent, over both ranks: every matrix's non-owner shards, in
        # bf16, to the owner and back.
        (idx, exchange), = opt._sharded(opt._muon_work())
        sent = torch.tensor([exchange.bytes_sent()])
        torch.distributed.all_reduce(sent)
        mine = [exchange.rects[exchange.coord][j] for j in range(len(idx))]
        res["exchange"] = (int(sent), exchange.shapes, [exchange.owner[j] for j in range(len(idx))],
                           rank, mine)

        # DCP checkpoint after SAVE_AFTER steps, then on: the run itself and a resumed one.
        dcp.save({"optim": get_optimizer_state_dict(sh, opt)}, checkpoint_id=ckpt_dir)
        res["saved_state"] = {name: {k: full(v).clone() for k, v in ref_opt.state[q].items()}
                              for (name, _), q in zip(sh.named_parameters(), ref.parameters())}
        res["saved_weights"] = {name: q.detach().clone() for name, q in ref.named_parameters()}
        weights = [p.detach().clone() for p in sh.parameters()]
        train_mean_square(ref, ref_opt, xs[SAVE_AFTER:])
        train_mean_square(sh, opt, xs[SAVE_AFTER:])
        res["equal"][(fmt, update)] = same(sh, opt, ref, ref_opt)

        resumed = fsdp(muon_model(dtype), mesh)
        with torch.no_grad():
            for p, w in zip(resumed.parameters(), weights):
                p.copy_(w)
        opt2 = LowBitMuon(resumed.named_parameters(), **kw)
        osd = get_optimizer_state_dict(resumed, opt2)
        res["osd_types"] = sorted({type(v).__name__ for st in osd["state"].values() for v in st.values()})
        dcp.load({"optim": osd}, checkpoint_id=ckpt_dir)
        set_optimizer_state_dict(resumed, opt2, optim_state_dict=osd)
        train_mean_square(resumed, opt2, xs[SAVE_AFTER:])
        res["resumed_equal"] = same(resumed, opt2, ref, ref_opt)

    # The fused kernels (interpreted here: the ranks run on the CPU) on each rank's shards
    # against the reference on the whole parameters; counted, so a path that never reached
    # them would not pass.
    from titan_lowbit.kernels import muon_lowbit

    write_weight, writes = muon_lowbit.write_weight, []
    muon_lowbit.write_weight = lambda *a, **k: (writes.append(1), write_weight(*a, **k))[1]
    for fmt, dtype, update in CASES[:3]:
        kw = dict(KW, state_format=fmt, weight_update=update)
        xs = inputs(2, dtype)
        ref, sh = muon_model(dtype), fsdp(muon_model(dtype), mesh)
        ref_opt, opt = LowBitMuon(ref.named_parameters(), **kw), LowBitMuon(sh.named_parameters(), **kw)
        opt._use_fused = lambda t: True
        train_mean_square(ref, ref_opt, xs)
        train_mean_square(sh, opt, xs)
        res["equal_fused"][(fmt, update)] = same(sh, opt, ref, ref_opt) if writes else "fused path not taken"
        writes.clear()

    # A nan in rank 1's shard of a Muon matrix: every rank stops, or skips, the step
    # (on the reference path; "raise" on the fused path too).
    kw = dict(KW, state_format="8bit", weight_update="stochastic")
    xs = inputs(2, torch.bfloat16)
    for policy in ("raise", "skip", "raise_fused"):
        model = fsdp(muon_model(), mesh)
        opt = LowBitMuon(model.named_parameters(), **kw, nonfinite_grad=policy.removesuffix("_fused"))
        if policy == "raise_fused":
            opt._use_fused = lambda t: True
        train_mean_square(model, opt, xs[:1])
        before = model[0].weight._local_tensor.clone()
        opt.zero_grad()
        model(xs[1]).float().square().mean().backward()
        if rank == 1:
            model[0].weight.grad._local_tensor[3, 5] = float("nan")
        try:
            opt.step()
            res[policy] = (None, opt.skipped_steps)
        except FloatingPointError as e:
            res[policy] = (str(e), opt.skipped_steps)
        res[policy] += (torch.equal(before, model[0].weight._local_tensor),)

    # Muon4bit's momentum factor on row shards: the owner makes the new factor from the
    # whole new momentum and sends each rank its rows of P (and all of R); reference path
    # and fused kernels (interpreted, counted) against the unsharded reference, and a DCP
    # checkpoint of the factor resumed bit for bit.
    kw = dict(KW, state_format="4bit", weight_update="stochastic", momentum_4bit_factor_rank=4)
    xs = inputs(2 * SAVE_AFTER, torch.bfloat16)
    for path in ("reference", "fused"):
        ref, sh = muon_model(), fsdp(muon_model(), mesh)
        ref_opt, opt = LowBitMuon(ref.named_parameters(), **kw), LowBitMuon(sh.named_parameters(), **kw)
        if path == "fused":
            opt._use_fused = lambda t: True
        train_mean_square(ref, ref_opt, xs[:SAVE_AFTER])
        train_mean_square(sh, opt, xs[:SAVE_AFTER])
        if path == "reference":
            dcp.save({"optim": get_optimizer_state_dict(sh, opt)}, checkpoint_id=ckpt_dir + "_factor")
            weights = [p.detach().clone() for p in sh.parameters()]
            res["factor_placements"] = {k: str(v.placements) for k, v in opt.state[sh[0].weight].items()
                                        if k.endswith("_factor")}
        train_mean_square(ref, ref_opt, xs[SAVE_AFTER:])
        train_mean_square(sh, opt, xs[SAVE_AFTER:])
        res[f"factor_equal_{path}"] = same(sh, opt, ref, ref_opt) if path == "reference" or writes else "not fused"
        writes.clear()
        if path == "reference":
            resumed = fsdp(muon_model(), mesh)
            with torch.no_grad():
                for p, w in zip(resumed.parameters(), weights):
                    p.copy_(w)
            opt2 = LowBitMuon(resumed.named_parameters(), **kw)
            osd = get_optimizer_state_dict(resumed, opt2)
            dcp.load({"optim": osd}, checkpoint_id=ckpt_dir + "_factor")
            set_optimizer_state_dict(resumed, opt2, optim_state_dict=osd)
            train_mean_square(resumed, opt2, xs[SAVE_AFTER:])
            res["factor_resumed_equal"] = same(resumed, opt2, ref, ref_opt)
    return res


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    folder = tmp_path_factory.mktemp("muon_sharded")
    ckpt = folder / "ckpt"
    res = run_on_gloo(functools.partial(_two_processes, ckpt_dir=str(ckpt)), 2, folder / "results.pt")
    return res, ckpt


def test_states_are_dtensors_placed_like_their_parameters(two):
    pl = two[0]["placements"]
    weight, states = pl["0.weight"]
    assert weight == "(Shard(dim=0),)"
    # 37 x 300: rows 19 + 18; 8-bit codes like the weight, one scale per block of 256 of a row
    assert states["momentum_buffer_codes"] == ("DTensor", "(Shard(dim=0),)", (37, 300), (19, 300))
    assert states["momentum_buffer_absmax"] == ("DTensor", "(Shard(dim=0),)", (37, 2), (19, 2))
    assert pl["1.weight"][1]["exp_avg"][0] == "DTensor"  # the AdamW part (the norm), sharded as well


@pytest.mark.parametrize("fmt,update", [(f, u) for f, _, u in CASES])
def test_sharded_steps_equal_unsharded_bit_for_bit(two, fmt, update):
    assert two[0]["equal"][(fmt, update)] is True


@pytest.mark.parametrize("fmt,update", [(f, u) for f, _, u in CASES[:3]])
def test_fused_kernels_on_shards_equal_unsharded_reference_bit_for_bit(two, fmt, update):
    assert two[0]["equal_fused"][(fmt, update)] is True


def test_exchange_sends_the_non_owner_shards_in_bf16_both_ways(two):
    sent, shapes, owners, _, _ = two[0]["exchange"]
    assert shapes == [(37, 300), (70, 37), (16, 70)]
    # owners balanced by size: the largest to rank 0, the next two to rank 1 (fewer elements)
    assert owners == [(0,), (1,), (1,)]
    rows = [(19, 18), (35, 35), (8, 8)]  # each rank's rows of each matrix
    non_owner = sum(r[1 - o[0]] * s[1] for r, o, s in zip(rows, owners, shapes))
    assert sent == 2 * 2 * non_owner  # bf16, to the owner and back


def test_dcp_checkpoint_resumes_bit_for_bit(two):
    assert "DTensor" in two[0]["osd_types"]
    assert two[0]["resumed_equal"] is True


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # 1 process: what we want
def test_two_process_checkpoint_loads_on_one_process(two):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from titan_lowbit.optim import LowBitMuon

    res, ckpt = two
    fmt, dtype, update = CASES[0]
    model = muon_model(dtype)
    opt = LowBitMuon(model.named_parameters(), **KW, state_format=fmt, weight_update=update)
    osd = get_optimizer_state_dict(model, opt)
    dcp.load({"optim": osd}, checkpoint_id=str(ckpt), no_dist=True)
    set_optimizer_state_dict(model, opt, optim_state_dict=osd)
    for name, p in model.named_parameters():
        want = res["saved_state"][name]
        assert set(opt.state[p]) == set(want), name
        for k, v in want.items():
            assert torch.equal(full(opt.state[p][k]), v), (name, k)


def test_nonfinite_gradient_in_one_shard_stops_or_skips_every_rank(two):
    msg, skipped, unchanged = two[0]["raise"]
    assert msg is not None and "param '0.weight'" in msg and skipped == 0 and unchanged
    msg, skipped, unchanged = two[0]["skip"]
    assert msg is None and skipped == 1 and unchanged
    assert two[0]["raise_fused"] == two[0]["raise"]


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_momentum_factor_on_row_shards_equals_unsharded_bit_for_bit(two, path):
    """Muon4bit's factor (rank 4) on FSDP2's row shards: P sharded by rows, R replicated;
    weights, codes, scales and both factors equal the unsharded optimizer's."""
    assert two[0]["factor_placements"] == {"momentum_buffer_row_factor": "(Shard(dim=0),)",
                                           "momentum_buffer_col_factor": "(Replicate(),)"}
    assert two[0][f"factor_equal_{path}"] is True, two[0][f"factor_equal_{path}"]


def test_momentum_factor_checkpoint_resumes_bit_for_bit(two):
    assert two[0]["factor_resumed_equal"] is True


# ---------------------------------------------------------------------------------------
# 4 processes: FSDP2 x TP (2 x 2) and HSDP (2 replicas x 2 shards)
# ---------------------------------------------------------------------------------------
def tp_model(dtype=torch.bfloat16):
    """A colwise (Shard(0) under TP; FSDP2 then shards its TP shards: strided) and a
    rowwise (Shard(1)) matrix; 43 rows of the rowwise one split 22 + 21 by FSDP2."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 160, bias=False), nn.Linear(160, 43, bias=False)).to(dtype)


def _four_processes(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from titan_lowbit.optim import LowBitMuon

    res = {"equal": {}, "equal_fused": {}}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # 8-bit blocks of 16: the rowwise matrix's 160 columns give each TP rank 80, whole blocks.
    for fmt, dtype, update in CASES[:2]:
        kw = dict(KW, state_format=fmt, weight_update=update, block_size=16 if fmt == "8bit" else 0)
        xs = inputs(3, dtype, width=64)
        ref, sh = tp_model(dtype), tp_model(dtype)
        parallelize_module(sh, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        fsdp(sh, mesh["dp"])
        if fmt == "8bit":
            res["tp_placements"] = [str(p.placements) for p in sh.parameters()]
        ref_opt = LowBitMuon(ref.named_parameters(), **kw)
        opt = LowBitMuon(sh.named_parameters(), **kw)
        for x in xs:  # TP's matmuls round otherwise: the reference steps on the same gradients
            opt.zero_grad()
            sh(x).float().square().mean().backward()
            for p, q in zip(sh.parameters(), ref.parameters()):
                q.grad = p.grad.full_tensor()
            opt.step()
            ref_opt.step()
        res["equal"][("tp", fmt, update)] = same(sh, opt, ref, ref_opt)

    # The default 8-bit block of 256 does not fit an 80-column TP shard: refused by name.
    sh = tp_model()
    parallelize_module(sh, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    try:
        LowBitMuon(sh.named_parameters(), **dict(KW, state_format="8bit"))
        res["tp_block_error"] = None
    except ValueError as e:
        res["tp_block_error"] = str(e)

    # A factor needs the old column factor whole at each matrix's owner: columns split by
    # tensor parallel (and FSDP2's strided shards over them) are refused by name.
    try:
        LowBitMuon(sh.named_parameters(), **dict(KW, state_format="4bit", block_size=16, momentum_4bit_factor_rank=4))
        res["tp_factor_error"] = None
    except ValueError as e:
        res["tp_factor_error"] = str(e)

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for fmt, dtype, update, extra in [(*CASES[0], {}), ("4bit", torch.bfloat16, "stochastic",
                                                        {"momentum_4bit_factor_rank": 4})]:
        kw = dict(KW, state_format=fmt, weight_update=update, **extra)
        xs = inputs(3, dtype)
        ref, sh = muon_model(dtype), fsdp(muon_model(dtype), hsdp)
        res["hsdp_placements"] = str(sh[0].weight.placements)
        ref_opt = LowBitMuon(ref.named_parameters(), **kw)
        opt = LowBitMuon(sh.named_parameters(), **kw)
        train_mean_square(ref, ref_opt, xs)
        train_mean_square(sh, opt, xs)
        res["equal"][("hsdp", fmt, update) + (("factor",) if extra else ())] = same(sh, opt, ref, ref_opt)
    res["exchange"] = _exchange_cases(rank)
    return res


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_on_gloo(_four_processes, 4, tmp_path_factory.mktemp("muon_sharded4") / "results.pt")


@pytest.mark.parametrize("fmt,update", [(f, u) for f, _, u in CASES[:2]])
def test_fsdp_x_tp_steps_equal_unsharded_bit_for_bit(four, fmt, update):
    assert four["tp_placements"] == ["(_StridedShard(dim=0, sf=2), Shard(dim=0))", "(Shard(dim=0), Shard(dim=1))"]
    assert four["equal"][("tp", fmt, update)] is True


def test_hsdp_steps_equal_unsharded_bit_for_bit(four):
    assert four["hsdp_placements"] == "(Replicate(), Shard(dim=0))"
    assert four["equal"][("hsdp",) + (CASES[0][0], CASES[0][2])] is True


def test_hsdp_steps_with_a_momentum_factor_equal_unsharded_bit_for_bit(four):
    assert four["equal"][("hsdp", "4bit", "stochastic", "factor")] is True


def test_tp_shard_that_splits_blocks_is_refused_by_name(four):
    err = four["tp_block_error"]
    assert err is not None and "param '1.weight'" in err and "block_size=16" in err, err


def test_momentum_factor_with_columns_split_by_tp_is_refused_by_name(four):
    err = four["tp_factor_error"]
    assert err is not None and (
        "param '1.weight': momentum_4bit_factor_rank=4 (a factor beside the 4-bit momentum) is not yet supported "
        "with a matrix's columns split over ranks, nor on FSDP2's strided shards (placements (Shard(dim=1),)): "
        "build the optimizer with "
        "momentum_4bit_factor_rank=0, or shard the matrix by rows only" in err), err


# ---------------------------------------------------------------------------------------
# The exchange alone (on the 4 processes above): a side matrix travels with the input and
# the owner's extra results, indexed by rows or by columns, come back in slices
# ---------------------------------------------------------------------------------------
def exchange_layouts():
    """name -> (mesh shape, mesh dimension names, placements, ranks of the mesh): rows
    over 2 and over 3 ranks (uneven; a 2-row matrix leaves one rank an empty shard),
    columns over 2 and 3, FSDP2 x TP (rows x columns, and columns x rows), HSDP
    (replicas x row shards)."""
    from torch.distributed.tensor import Replicate, Shard

    return {"rows over 2": ((2,), ("fsdp",), (Shard(0),), 2), "rows over 3": ((3,), ("fsdp",), (Shard(0),), 3),
            "cols over 2": ((2,), ("tp",), (Shard(1),), 2), "cols over 3": ((3,), ("tp",), (Shard(1),), 3),
            "fsdp x tp": ((2, 2), ("dp", "tp"), (Shard(0), Shard(1)), 4),
            "tp x fsdp": ((2, 2), ("dp", "tp"), (Shard(1), Shard(0)), 4),
            "hsdp": ((2, 2), ("replicate", "shard"), (Replicate(), Shard(0)), 4)}


def exchange_matrices():
    """Ragged matrices (one bucket), each with its declared extras (k and dtypes vary; one
    declares none), the Newton-Schulz-like input and the side matrix, fp32, the same on
    every rank."""
    from titan_lowbit.optim.muon_exchange import COLS, ROWS, Extra

    gen = torch.Generator().manual_seed(11)
    shapes = [(37, 23), (5, 41), (2, 7), (64, 9), (12, 30)]
    extras = [(Extra(ROWS, 3, torch.float32), Extra(COLS, 3, torch.bfloat16)),
              (Extra(COLS, 2, torch.float32), Extra(ROWS, 2, torch.float32)),
              (Extra(ROWS, 1, torch.bfloat16), Extra(COLS, 1, torch.float32)),
              (Extra(ROWS, 5, torch.float32),), ()]
    inputs = [torch.randn(s, generator=gen) for s in shapes]
    side = [torch.randn(s, generator=gen) for s in shapes]
    return extras, inputs, side


def owner_work(j, whole_input, whole_side, extras):
    """A deterministic stand-in for the owner's work: a result and the declared extras,
    each a function of the whole input and the whole side matrix (a transposed one among
    them, as R = U[:k].T would be)."""
    result = (whole_input.float() * 3 - whole_side.float()).to(torch.bfloat16)
    out = []
    for e in extras:
        k = e.width
        if e.along == 0:  # [rows, k]
            x = whole_side[:, :k].float() * 2 + whole_input[:, -k:].float()
        else:  # [cols, k]
            x = whole_input[:k].T.float() - whole_side[-k:].T.float() * 0.5
        out.append(x.to(e.dtype))
    return result, tuple(out)


def _exchange_cases(rank):
    """Every rank's findings per layout (``exchange_on``), gathered to rank 0; on the
    3-rank layouts rank 3 sits out."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    found = {}
    for name, (shape, dim_names, placements, ranks) in exchange_layouts().items():
        mesh = DeviceMesh("cpu", torch.arange(ranks).reshape(shape), mesh_dim_names=dim_names)
        if mesh.get_coordinate() is not None:
            found[name] = exchange_on(mesh, placements)
        if name == "rows over 2" and mesh.get_coordinate() is not None:
            found["refused"] = exchange_refusals(mesh, placements)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    return everyone


def exchange_on(mesh, placements):
    """One exchange of ``exchange_matrices`` placed so on ``mesh``, with the side matrix
    and the extras: this rank's result shard and its extras' slices against
    ``owner_work`` on the whole matrices in this process, whether the wholes its owned
    matrices' work saw were the assembled bf16 matrices, its rectangles, the owners, and
    the bytes it sends."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from titan_lowbit.optim.muon_exchange import OwnerExchange, split_dims

    extras, inputs, side = exchange_matrices()
    bf16 = [(u.to(torch.bfloat16), m.to(torch.bfloat16)) for u, m in zip(inputs, side)]
    params = [distribute_tensor(u, mesh, placements) for u in inputs]
    dims = split_dims(params[0], "matrix")
    exchange = OwnerExchange(params, dims)
    seen = {}

    def work(j, whole_input, whole_side):
        seen[j] = (torch.equal(whole_input, bf16[j][0]) and whole_input.dtype == torch.bfloat16,
                   torch.equal(whole_side, bf16[j][1]) and whole_side.dtype == torch.bfloat16)
        return owner_work(j, whole_input, whole_side, extras[j])

    side_shards = [distribute_tensor(m, mesh, placements).to_local() for m in side]
    outputs, slices = exchange.run([p.to_local() for p in params], work, side=side_shards, extras=extras)
    bad = []
    for j, p in enumerate(params):
        (rows, cols), (r0, c0) = compute_local_shape_and_global_offset(p.shape, mesh, placements)
        result, results = owner_work(j, *bf16[j], extras[j])
        if not torch.equal(outputs[j], result[r0:r0 + rows, c0:c0 + cols]):
            bad.append(f"matrix {j}: result")
        if len(slices[j]) != len(extras[j]):
            bad.append(f"matrix {j}: {len(slices[j])} extras")
        for i, (got, want, e) in enumerate(zip(slices[j], results, extras[j])):
            first, count = (r0, c0)[e.along], (rows, cols)[e.along]
            if got.dtype != e.dtype or not torch.equal(got, want[first:first + count]):
                bad.append(f"matrix {j}: extra {i}")
    return {"dims": dims, "bad": bad, "seen": seen, "rects": exchange.rects[exchange.coord],
            "owners": exchange.owner, "coord": exchange.coord,
            "bytes": (exchange.bytes_sent(), exchange.bytes_sent(side=True, extras=extras))}


def exchange_refusals(mesh, placements):
    """What run says, alike on every rank and before anything travels, to a side matrix
    short of one matrix and to an extra indexed by neither rows nor columns."""
    from torch.distributed.tensor import distribute_tensor

    from titan_lowbit.optim.muon_exchange import Extra, OwnerExchange, split_dims

    extras, inputs, side = exchange_matrices()
    params = [distribute_tensor(u, mesh, placements) for u in inputs]
    exchange = OwnerExchange(params, split_dims(params[0], "matrix"))
    shards = [p.to_local() for p in params]
    side_shards = [distribute_tensor(m, mesh, placements).to_local() for m in side]
    said = []
    for kw in ({"side": side_shards[:-1], "extras": extras},
               {"side": side_shards, "extras": [(Extra(2, 1, torch.float32),), *extras[1:]]}):
        try:
            exchange.run(shards, lambda j, u, m: owner_work(j, u, m, extras[j]), **kw)
            said.append(None)
        except ValueError as e:
            said.append(str(e))
    return said


def layout_ranks(four, layout):
    """Every rank's findings for ``layout`` (the ranks of its mesh)."""
    return [r[layout] for r in four["exchange"] if layout in r]


@pytest.mark.parametrize("layout", list(exchange_layouts()))
def test_exchange_returns_result_shards_and_extra_slices_bit_for_bit(four, layout):
    """Every rank's shard of the result and its rows of each extra (by its rows or its
    columns) equal the owner's work done on the whole matrices in one process, bit for
    bit and in the extra's dtype; each owner saw the assembled bf16 input and side matrix;
    each matrix's work ran once per replica (HSDP: twice, once per replica)."""
    _, _, placements, ranks = exchange_layouts()[layout]
    found = layout_ranks(four, layout)
    assert len(found) == ranks
    assert all(r["bad"] == [] for r in found), [r["bad"] for r in found]
    assert found[0]["dims"] == tuple(d for d, pl in enumerate(placements) if pl.is_shard())
    replicas = 2 if layout == "hsdp" else 1
    extras = exchange_matrices()[0]
    assert sorted(j for r in found for j in r["seen"]) == sorted(list(range(len(extras))) * replicas)
    assert all(v == (True, True) for r in found for v in r["seen"].values())


@pytest.mark.parametrize("layout", ["rows over 3", "cols over 2"])
def test_exchange_with_side_and_extras_sends_both_matrices_out_and_the_slices_back(four, layout):
    """Over one mesh dimension: each non-owner shard goes to the owner as input and side
    matrix (bf16) and comes back as result (bf16) with its slices of the extras (their
    own dtypes); without them, the input out and the result back, as ever."""
    found = layout_ranks(four, layout)
    extras = exchange_matrices()[0]
    plain = side = 0
    for r in found:
        for j, declared in enumerate(extras):
            if r["coord"] == r["owners"][j]:
                continue
            _, _, rows, cols = r["rects"][j]
            plain += 2 * 2 * rows * cols
            side += 3 * 2 * rows * cols + sum((rows, cols)[e.along] * e.width * e.dtype.itemsize for e in declared)
    assert sum(r["bytes"][0] for r in found) == plain
    assert sum(r["bytes"][1] for r in found) == side > plain


def test_exchange_refuses_a_side_or_extras_that_do_not_fit(four):
    side_count, bad_extra = layout_ranks(four, "refused")[0]
    assert side_count is not None and "side holds 4 tensors for the exchange's 5 matrices" in side_count
    assert bad_extra is not None and "matrix 0's extra Extra(along=2" in bad_extra


def test_owners_balance_elements_across_buckets():
    """Largest first, to the least loaded rank; a later bucket of the same mesh starts from
    the load the earlier ones left (else rank 0 would take every bucket's odd matrix)."""
    from titan_lowbit.optim.muon_exchange import balanced_owners

    load = [0, 0]
    assert balanced_owners([5, 5, 5], load) == [0, 1, 0] and load == [10, 5]
    assert balanced_owners([5], load) == [1] and load == [10, 10]
    assert balanced_owners([1, 7, 3], [0, 0, 0]) == [2, 0, 1]
