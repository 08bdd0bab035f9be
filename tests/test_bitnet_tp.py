"""BitNet under tensor parallelism and FSDP2 x TP on four gloo processes (CPU, reference
kernels): the sharded layers must compute what the unsharded BitNet model computes.

One gloo run (conftest.run_on_gloo) runs every scenario on a 2 x 2 mesh (dp, tp) and
hands rank 0's measurements to the tests below. The model is a llama-style feed-forward, w2(silu(w1 x) * w3 x), with
w1 and w3 column-wise and w2 row-wise parallel, as torchtitan's plan shards them. The
input has 38 features (packed all-gather rows are padded) and rows whose abs-max lies on
different TP shards, so a rank quantizing with its local row maxima would be caught.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import run_on_gloo

WORLD = 4
DIM, HIDDEN = 38, 64
STEPS = 3
# Sharded and unsharded results differ only in the order partial products are summed.
TOL = 2e-5


class _FeedForward(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=True)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=True)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _scenarios(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from titan_lowbit.bitnet import CONVERTERS, convert_to_bitnet, enable_tensor_parallel
    from titan_lowbit.config import LowBit

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    res = {}

    torch.manual_seed(7)
    # Per step: one batch per dp rank (6 rows x 38), same on both TP ranks of a dp group.
    batches = [[torch.randn(6, DIM) * torch.rand(6, 1) * 4 for _ in range(2)] for _ in range(STEPS)]

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    def run(tag, sharded, conv, data_parallel):
        ref = _FeedForward()
        conv.convert(ref)
        opt_s = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
        opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        out_err, grad_err, dx_err, sum_err, issued = [], [], [], [], []
        for xs in batches:
            x_ref = torch.cat(xs).requires_grad_()
            y_ref = ref(x_ref)
            # Each dp rank's loss is the mean over its rows; FSDP averages over dp ranks.
            (y_ref.square().mean(dim=1).view(2, -1).mean(dim=1).mean()).backward()
            x = (xs[dp_rank] if data_parallel else x_ref.detach()[:]).clone().requires_grad_()
            y = sharded(x)
            loss = y.square().mean(dim=1).view(1 if data_parallel else 2, -1).mean(dim=1).mean()
            loss.backward()
            rows = slice(6 * dp_rank, 6 * dp_rank + 6) if data_parallel else slice(None)
            out_err.append(_rel(full(y).detach(), y_ref.detach()[rows]))
            dx_ref = x_ref.grad[rows] * (2 if data_parallel else 1)
            dx_err.append(_rel(x.grad, dx_ref))
            grad_err.append(max(_rel(full(ps.grad), pr.grad)
                                for ps, pr in zip(sharded.parameters(), ref.parameters())))
            opt_s.step(), opt_r.step()
            opt_s.zero_grad(), opt_r.zero_grad()
            issued.append(conv.post_optimizer_hook([sharded]))
            sums = []
            for name, p in sharded.named_parameters():
                local = p._local_tensor if isinstance(p, DTensor) else p
                s = getattr(local, "_precomputed_abs_sum", None)
                if s is not None:
                    sums.append(_rel(s, full(p).detach().abs().sum()))
            sum_err.append(max(sums) if sums else None)
        # Weights doubled through the parameters after the hook (as load_state_dict
        # writes): the precomputed sums are stale, and the next forward must quantize with
        # the new ones, like the unsharded model written the same way.
        with torch.no_grad():
            for ps, pr in zip(sharded.parameters(), ref.parameters()):
                ps.mul_(2)
                pr.mul_(2)
        xs = batches[0]
        y_ref = ref(torch.cat(xs)).detach()
        y = sharded(xs[dp_rank] if data_parallel else torch.cat(xs))
        rows = slice(6 * dp_rank, 6 * dp_rank + 6) if data_parallel else slice(None)
        written = _rel(full(y).detach(), y_ref[rows])
        # Fresh sums, then the weights tripled through a state-dict alias, into its local
        # tensor as DCP's in-place load writes (with no load_state_dict after it): no op of
        # the weight sees it, only the latent tensor's version counter moves.
        conv.post_optimizer_hook([sharded])
        aliases = sharded.state_dict()
        with torch.no_grad():
            for (name, pr) in ref.named_parameters():
                if name.endswith("weight"):
                    aliases[name].to_local().mul_(3)
                    pr.mul_(3)
        y_ref = ref(torch.cat(xs)).detach()
        y = sharded(xs[dp_rank] if data_parallel else torch.cat(xs))
        written_alias = _rel(full(y).detach(), y_ref[rows])
        res[tag] = dict(out=out_err, grad=grad_err, dx=dx_err, sums=sum_err, issued=issued, written=written,
                        written_alias=written_alias,
                        local=sorted({type(p._local_tensor).__name__ for n, p in sharded.named_parameters()
                                      if n.endswith("weight")}))

    # the collective of a scale's sum over the ranks (weight.sum_over_ranks)
    import torch.distributed._functional_collectives as funcol

    sum_calls = []
    orig_all_gather = funcol.all_gather_tensor

    def counting_all_gather(*args, **kwargs):
        sum_calls.append(1)
        return orig_all_gather(*args, **kwargs)

    class _CountingConverter:
        """The bitnet converter, reporting how many scale collectives its hook issued."""

        def __init__(self, precompute):
            job = SimpleNamespace(lowbit=LowBit(bitnet_filter=[], bitnet_precompute_scale=precompute))
            self.conv = CONVERTERS["bitnet"](job, SimpleNamespace(tp_enabled=True))

        def convert(self, model):
            self.conv.convert(model)

        def post_optimizer_hook(self, parts):
            sum_calls.clear()
            funcol.all_gather_tensor = counting_all_gather
            try:
                self.conv.post_optimizer_hook(parts)
            finally:
                funcol.all_gather_tensor = orig_all_gather
            return len(sum_calls)

    for precompute in (True, False):
        # Tensor parallelism alone (each dp group computes the same model on all rows).
        conv = _CountingConverter(precompute)
        tp_model = _FeedForward()
        conv.convert(tp_model)
        parallelize_module(tp_model, mesh["tp"], plan)
        enable_tensor_parallel(tp_model, mesh["tp"])
        run(f"tp_{'pre' if precompute else 'nopre'}", tp_model, conv, data_parallel=False)

        # FSDP2 over dp x TP over tp.
        conv = _CountingConverter(precompute)
        model = _FeedForward()
        conv.convert(model)
        parallelize_module(model, mesh["tp"], plan)
        for name in ("w1", "w3", "w2"):
            fully_shard(getattr(model, name), mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        res.setdefault("tp_layers", enable_tensor_parallel(model, mesh["tp"]))
        run(f"fsdp_tp_{'pre' if precompute else 'nopre'}", model, conv, data_parallel=True)

    # torchtitan's plan: the block's input is sequence-sharded, one PrepareModuleInput
    # gathers it for w1 and w3, and w2's output is reduce-scattered back. BitNet must add
    # only its row abs-max all-reduces to the collectives plain linears issue: x's for
    # w2 forward, dy's for w1 and w3 backward (w1 and w3's dx stay one reduce-scatter).
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import PrepareModuleInput

    seq_plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                "w2": RowwiseParallel(output_layouts=Shard(1))}
    res["comms"] = {}
    for kind in ("linear", "bitnet"):
        model, conv = _FeedForward(), _CountingConverter(True)
        if kind == "bitnet":
            conv.convert(model)
        parallelize_module(model, mesh["tp"], PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)))
        parallelize_module(model, mesh["tp"], seq_plan)
        if kind == "bitnet":
            enable_tensor_parallel(model, mesh["tp"])
            conv.post_optimizer_hook([model])  # precomputed scales: no per-layer sum
        x = batches[0][0].view(1, 6, DIM).chunk(2, dim=1)[mesh["tp"].get_local_rank()]
        x = x.clone().requires_grad_()
        with CommDebugMode() as comm:
            model(x).square().sum().backward()
        res["comms"][kind] = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}

    # Built on the meta device and materialized after enable_tensor_parallel, as torchtitan
    # does (to_empty gives every parameter a new local tensor): a write through a
    # state-dict alias after the sums were precomputed is still seen.
    from torch.distributed.tensor import distribute_tensor
    conv = _CountingConverter(True)
    ref = _FeedForward()
    conv.convert(ref)
    with torch.device("meta"):
        meta_model = _FeedForward()
    conv.convert(meta_model)
    parallelize_module(meta_model, mesh["tp"], plan)
    enable_tensor_parallel(meta_model, mesh["tp"])
    meta_model.to_empty(device="cpu")
    with torch.no_grad():
        for (name, p), pr in zip(meta_model.named_parameters(), ref.parameters()):
            p.to_local().copy_(distribute_tensor(pr.detach(), mesh["tp"], p.placements).to_local())
    conv.post_optimizer_hook([meta_model])
    aliases = meta_model.state_dict()
    with torch.no_grad():
        for name, pr in ref.named_parameters():
            if name.endswith("weight"):
                aliases[name].to_local().mul_(3)
                pr.mul_(3)
    x = torch.cat(batches[0])
    res["meta_init_written_alias"] = _rel(full(meta_model(x)).detach(), ref(x).detach())

    # FSDP x TP without enable_tensor_parallel: the scale would miss the TP sum; refused.
    model = _FeedForward()
    convert_to_bitnet(model, [])
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    try:
        model(torch.randn(3, DIM))
        res["missing_enable"] = None
    except RuntimeError as e:
        res["missing_enable"] = str(e)

    # A converted nn.Linear subclass keeps its class: refused under TP, naming the layer.
    class _MyLinear(nn.Linear):
        pass

    sub = nn.Sequential(_MyLinear(DIM, HIDDEN))
    convert_to_bitnet(sub, [])
    parallelize_module(sub, mesh["tp"], {"0": ColwiseParallel()})
    try:
        enable_tensor_parallel(sub, mesh["tp"])
        res["subclass_error"] = None
    except TypeError as e:
        res["subclass_error"] = str(e)
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_gloo(_scenarios, WORLD, tmp_path_factory.mktemp("bitnet_tp") / "res.pt")


@pytest.mark.parametrize("tag", ["tp_pre", "tp_nopre", "fsdp_tp_pre", "fsdp_tp_nopre"])
def test_sharded_bitnet_equals_unsharded(results, tag):
    r = results[tag]
    assert max(r["out"]) < TOL, r["out"]
    assert max(r["dx"]) < TOL, r["dx"]
    assert max(r["grad"]) < TOL, r["grad"]
    # after a write that made the precomputed sums stale (a stale sum misses by a factor),
    # through the parameters and through a state-dict alias
    assert r["written"] < TOL, r["written"]
    assert r["written_alias"] < TOL, r["written_alias"]


def test_tp_sees_an_alias_write_after_meta_device_init(results):
    assert results["meta_init_written_alias"] < TOL, results["meta_init_written_alias"]


def test_fsdp_x_tp_gathers_ternary_codes(results):
    assert results["fsdp_tp_pre"]["local"] == ["BitNetTrainingWeight"]
    assert results["tp_layers"] == ["w1", "w3", "w2"]


def test_precomputed_sums_cover_every_shard(results):
    # One collective per sharded mesh dimension for all layers: TP alone 1, FSDP x TP 2
    # (w1 and w3 share their groups with w2; biases are not BitNet weights).
    assert results["tp_pre"]["issued"] == [1] * STEPS
    assert results["fsdp_tp_pre"]["issued"] == [2] * STEPS
    assert results["tp_nopre"]["issued"] == [0] * STEPS
    for tag in ("tp_pre", "fsdp_tp_pre"):
        assert max(results[tag]["sums"]) < 1e-6, results[tag]["sums"]


def test_tp_misuse_is_a_clear_error(results):
    assert "enable_tensor_parallel" in results["missing_enable"]
    assert "'0'" in results["subclass_error"] and "bitnet_filter" in results["subclass_error"]


def test_tp_adds_only_the_row_absmax_all_reduces(results):
    linear, bitnet = results["comms"]["linear"], results["comms"]["bitnet"]
    assert linear.get("reduce_scatter_tensor", 0) >= 2, linear  # w2's y, w1 and w3's dx
    extra = {op: bitnet.get(op, 0) - linear.get(op, 0) for op in set(linear) | set(bitnet)}
    assert {op: n for op, n in extra.items() if n} == {"all_reduce": 3}, (linear, bitnet)
