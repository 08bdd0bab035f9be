"""LowBitAdamW under FSDP2 on two gloo processes (CPU, reference path).

One gloo run (conftest.run_on_gloo) runs every scenario and hands rank 0's results to
the tests below:
* states are DTensors with the parameter's mesh and placements (eager, before any step);
* sharded training equals unsharded training bit for bit (the math is per element, and
  stochastic rounding is keyed by the global element index);
* torch.distributed.checkpoint's get/set_optimizer_state_dict round-trips into a fresh
  optimizer before its first step, and training continues identically;
* Shard on the last dimension that splits a quantization block is refused by name.
"""

import pytest
import torch
import torch.nn as nn

from conftest import run_on_gloo, sharded_small_model, small_bf16_model, train_mean_square

WORLD = 2
# (state format, parameter dtype, bf16 update) beyond the main 4-bit + stochastic case.
FORMAT_CASES = [("8bit", torch.float32, "nearest"), ("fp8", torch.float32, "nearest"),
                ("fp32", torch.float32, "nearest"), ("8bit", torch.bfloat16, "kahan"),
                ("bf16", torch.bfloat16, "master"), ("fp8", torch.bfloat16, "nearest")]



def _scenarios(rank):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from titan_lowbit.optim import LowBitAdamW

    mesh = init_device_mesh("cpu", (WORLD,))
    kw = dict(lr=1e-2, weight_decay=0.1, state_format="4bit", weight_update="stochastic",
              min_quantized_numel=1000, seed=3)
    res = {}

    def sharded_model():
        return sharded_small_model(mesh)

    train = train_mean_square

    torch.manual_seed(1)
    xs = [torch.randn(4, 300).to(torch.bfloat16) for _ in range(6)]
    ref = small_bf16_model()
    opt_r = LowBitAdamW(list(ref.named_parameters()), **kw)
    sh = sharded_model()
    opt_s = LowBitAdamW(list(sh.named_parameters()), **kw)

    res["placements"] = {
        name: (str(p.placements), {k: (type(v).__name__, str(getattr(v, "placements", None)),
                                        tuple(v.shape), tuple(v._local_tensor.shape) if isinstance(v, DTensor) else None)
                                   for k, v in opt_s.state[p].items()})
        for name, p in sh.named_parameters()}

    train(ref, opt_r, xs[:3])
    train(sh, opt_s, xs[:3])
    res["max_diff_after_3"] = max((ps.full_tensor().float() - pr.float()).abs().max().item()
                                  for ps, pr in zip(sh.parameters(), ref.parameters()))

    # Every other state format and update rule: 2 processes equal 1 process, bit for bit.
    res["formats_max_diff"] = {}
    for fmt, dtype, update in FORMAT_CASES:
        kw_f = dict(kw, state_format=fmt, weight_update=update)
        ref_f = small_bf16_model().to(dtype)
        sh_f = small_bf16_model().to(dtype)
        for mod in sh_f:
            if isinstance(mod, nn.Linear):
                fully_shard(mod, mesh=mesh)
        fully_shard(sh_f, mesh=mesh)
        xs_f = [x.to(dtype) for x in xs[:3]]
        train(ref_f, LowBitAdamW(list(ref_f.named_parameters()), **kw_f), xs_f)
        train(sh_f, LowBitAdamW(list(sh_f.named_parameters()), **kw_f), xs_f)
        res["formats_max_diff"][(fmt, str(dtype), update)] = max(
            (ps.full_tensor().float() - pr.float()).abs().max().item()
            for ps, pr in zip(sh_f.parameters(), ref_f.parameters()))

    # Checkpoint through DCP's state-dict API and load into a fresh optimizer before its first step.
    osd = get_optimizer_state_dict(sh, opt_s)
    res["osd_types"] = sorted({type(v).__name__ for st in osd["state"].values() for v in st.values()})
    fresh = LowBitAdamW(list(sh.named_parameters()), **kw)
    set_optimizer_state_dict(sh, fresh, optim_state_dict=osd)
    train(ref, opt_r, xs[3:])
    train(sh, fresh, xs[3:])
    res["max_diff_after_resume"] = max((ps.full_tensor().float() - pr.float()).abs().max().item()
                                       for ps, pr in zip(sh.parameters(), ref.parameters()))
    res["state_equal_after_resume"] = all(
        torch.equal(fresh.state[ps][k].full_tensor() if isinstance(fresh.state[ps][k], DTensor) else fresh.state[ps][k],
                    opt_r.state[pr][k])
        for ps, pr in zip(sh.parameters(), ref.parameters()) for k in opt_r.state[pr])

    # Column-sharded parameter whose shards would split 8-bit blocks of 256.
    w = nn.Parameter(distribute_tensor(torch.randn(8, 768), mesh, [Shard(1)]))
    try:
        LowBitAdamW([("tp.w", w)], state_format="8bit", min_quantized_numel=0)
        res["col_shard_error"] = None
    except ValueError as e:
        res["col_shard_error"] = str(e)
    ok = nn.Parameter(distribute_tensor(torch.randn(8, 1024), mesh, [Shard(1)]))
    opt_ok = LowBitAdamW([("tp.ok", ok)], state_format="8bit", min_quantized_numel=0)
    res["col_shard_state"] = (str(opt_ok.state[ok]["exp_avg_absmax"].placements),
                              tuple(opt_ok.state[ok]["exp_avg_absmax"]._local_tensor.shape))

    # Column-sharded (TP-style) parameters step exactly like unsharded ones, stochastic
    # rounding included (global element index), for a quantized and a plain format.
    diffs = {}
    for fmt in ("8bit", "fp32"):
        torch.manual_seed(4)
        full = torch.randn(6, 512).to(torch.bfloat16)
        w_tp = nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(1)]))
        w_ref = nn.Parameter(full.clone())
        kw_tp = dict(lr=1e-2, state_format=fmt, weight_update="stochastic", min_quantized_numel=0, seed=9)
        o_tp, o_ref = LowBitAdamW([w_tp], **kw_tp), LowBitAdamW([w_ref], **kw_tp)
        for _ in range(3):
            g = torch.randn(6, 512)  # same on both ranks (seeded above)
            w_tp.grad = distribute_tensor(g.to(torch.bfloat16), mesh, [Shard(1)])
            w_ref.grad = g.to(torch.bfloat16)
            o_tp.step()
            o_ref.step()
        diffs[fmt] = (w_tp.full_tensor().float() - w_ref.float()).abs().max().item()
    res["col_shard_step_diff"] = diffs

    # Gradients that leave the step plan's one-pass check of DTensor gradients (placements
    # as the parameter's, local shards of the first step's dtype, shape and contiguity)
    # take the per-parameter path: a Partial gradient of a Replicate parameter is reduced,
    # a Shard(0) gradient whose local shard is a transposed view is read by value. The
    # interpreted Triton kernel steps the DTensors, the reference the plain tensors.
    from torch.distributed.tensor import Partial, Replicate

    torch.manual_seed(5)
    full_r, full_s = torch.randn(8, 512).to(torch.bfloat16), torch.randn(8, 512).to(torch.bfloat16)
    w_r = nn.Parameter(distribute_tensor(full_r.clone(), mesh, [Replicate()]))
    w_s = nn.Parameter(distribute_tensor(full_s.clone(), mesh, [Shard(0)]))
    ref_r, ref_s = nn.Parameter(full_r.clone()), nn.Parameter(full_s.clone())
    kw_g = dict(lr=1e-2, state_format="8bit", weight_update="stochastic", min_quantized_numel=0, seed=2)
    o_d, o_p = LowBitAdamW([w_r, w_s], **kw_g), LowBitAdamW([ref_r, ref_s], **kw_g)
    o_d._use_fused = lambda t: True
    kinds = []
    for step in range(3):
        g_r, g_s = torch.randn(8, 512).to(torch.bfloat16), torch.randn(8, 512).to(torch.bfloat16)
        if step == 1:  # each rank holds a part of the sum (exact in bf16: halves)
            w_r.grad = DTensor.from_local(g_r * 0.5, mesh, [Partial()], run_check=False)
        else:
            w_r.grad = distribute_tensor(g_r, mesh, [Replicate()])
        rows = g_s.chunk(WORLD)[rank]
        local = rows.t().contiguous().t() if step == 2 else rows.clone()
        w_s.grad = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        kinds.append((str(w_r.grad.placements), w_s.grad._local_tensor.is_contiguous()))
        ref_r.grad, ref_s.grad = g_r, g_s
        o_d.step()
        o_p.step()
    res["grad_fallback_kinds"] = kinds
    res["grad_fallback_plan_kind"] = o_d._step_plan.kind
    res["grad_fallback_equal"] = (torch.equal(w_r.full_tensor(), ref_r.detach())
                                  and torch.equal(w_s.full_tensor(), ref_s.detach()))

    # A nan in rank 1's shard only: every rank must take the same decision.
    for policy in ("raise", "skip"):
        model = sharded_model()
        opt = LowBitAdamW(list(model.named_parameters()), **{**kw, "nonfinite_grad": policy})
        train(model, opt, xs[:1])
        opt.zero_grad()
        model(xs[1]).float().square().mean().backward()
        if rank == 1:
            model[0].weight.grad._local_tensor[2, 7] = float("nan")
        opt.step()
        if policy == "skip":
            res["nonfinite_skip"] = (opt.skipped_steps, int(opt.state[model[0].weight]["step"]))
            continue
        opt.zero_grad()
        model(xs[2]).float().square().mean().backward()
        try:
            opt.step()
            res["nonfinite_raise"] = None
        except FloatingPointError as e:
            res["nonfinite_raise"] = (str(e), int(opt.state[model[0].weight]["step"]))

    # A state dict whose shard on rank 1 alone holds a NaN scale: every rank refuses it
    # (the check combines over the parameters' mesh), and none has loaded anything.
    model = sharded_model()
    opt = LowBitAdamW(list(model.named_parameters()), **kw)
    train(model, opt, xs[:1])
    saved = opt.state_dict()
    before = {k: v._local_tensor.clone() for k, v in opt.state[model[0].weight].items()
              if isinstance(v, DTensor)}
    absmax = next(k for k in saved["state"][0] if k.endswith("absmax"))
    damaged = saved["state"][0][absmax].clone()  # state_dict() shares the live state tensors
    if rank == 1:
        damaged._local_tensor[0] = float("nan")
    saved = {**saved, "state": {**saved["state"], 0: {**saved["state"][0], absmax: damaged}}}
    try:
        opt.load_state_dict(saved)
        res["damaged_shard"] = None
    except ValueError as e:
        res["damaged_shard"] = (str(e), all(torch.equal(v._local_tensor, before[k])
                                             for k, v in opt.state[model[0].weight].items() if k in before))
    return res


def test_a_damaged_state_shard_on_one_rank_is_refused_on_every_rank(results):
    """Rank 0's shard is sound; it refuses the state dict too, naming the entry, and
    keeps its state."""
    msg, unchanged = results["damaged_shard"]
    assert "state entry 'exp_avg" in msg and "absmax" in msg and "another rank" in msg, msg
    assert unchanged


def test_a_nonfinite_gradient_on_one_rank_stops_or_skips_every_rank(results):
    """raise: rank 0 (finite shard) raises at the next step too, naming no parameter of
    its own, before that step changes anything; skip: rank 0 skips the step as well."""
    msg, step = results["nonfinite_raise"]
    assert "a parameter on another rank at optimizer step 2" in msg and step == 2
    assert results["nonfinite_skip"] == (1, 1)


def test_dtensor_gradients_that_leave_the_fast_check_are_reduced_or_copied(results):
    assert results["grad_fallback_plan_kind"] == "dtensor"
    assert [k for k, _ in results["grad_fallback_kinds"]][1] == "(Partial(sum),)"
    assert [c for _, c in results["grad_fallback_kinds"]] == [True, True, False]
    assert results["grad_fallback_equal"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_gloo(_scenarios, WORLD, tmp_path_factory.mktemp("optim_fsdp") / "results.pt")


def test_states_are_dtensors_with_param_placements(results):
    pl = results["placements"]
    w = pl["0.weight"]
    assert w[0] == "(Shard(dim=0),)"
    for key in ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax"):
        kind, placements, gshape, lshape = w[1][key]
        assert kind == "DTensor" and placements == "(Shard(dim=0),)"
        assert lshape[0] == 35 and gshape[0] == 70
    assert w[1]["exp_avg_codes"][2] == (70, 150) and w[1]["exp_avg_absmax"][2] == (70, 3)
    assert pl["1.weight"][1]["exp_avg"][0] == "DTensor"  # small: fp32 state, still sharded
    assert pl["0.weight"][1]["step"][0] == "Tensor"


def test_sharded_training_equals_unsharded(results):
    assert results["max_diff_after_3"] == 0.0


def test_dcp_round_trip_before_first_step_resumes_identically(results):
    assert "DTensor" in results["osd_types"]
    assert results["max_diff_after_resume"] == 0.0
    assert results["state_equal_after_resume"]


def test_column_sharded_step_equals_unsharded(results):
    assert results["col_shard_step_diff"] == {"8bit": 0.0, "fp32": 0.0}


def test_last_dim_shard_splitting_blocks_is_refused(results):
    err = results["col_shard_error"]
    assert err is not None and "'tp.w'" in err and "block_size=128" in err
    assert results["col_shard_state"] == ("(Shard(dim=1),)", (8, 2))


def test_every_format_sharded_equals_unsharded(results):
    """2 processes (FSDP2) and 1 process on the same global batch end with the same bits,
    for every state format and bf16 update rule."""
    diffs = results["formats_max_diff"]
    assert len(diffs) == len(FORMAT_CASES)
    assert all(d == 0.0 for d in diffs.values()), diffs
