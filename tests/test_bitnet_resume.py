"""A BitNet run resumed from a DCP checkpoint continues the uninterrupted run bit for bit,
under FSDP2, tensor parallelism and FSDP2 x TP, on four gloo processes (CPU, reference
kernels), with torch's AdamW and with AdamW8bit.

After an optimizer step the converter's hook precomputes every weight's sum |W| for all
layers at once; after a checkpoint load the sums are gone, and the first step sums each
layer's |W| inside its all-gather (FSDP) or forward (TP). Both must give a weight the same
scale to the last bit, or the resumed run drifts from the uninterrupted one.

On the CPU every reduction order happens to agree, so the test makes them disagree the way
GPUs do, in each rank:
- ``torch._foreach_norm`` (CUDA's multi-tensor kernel: per-tensor chunks, then the chunks'
  sums) sums in another order than ``torch.linalg.vector_norm``;
- a sum all-reduce adds the ranks' values in an order that depends on the element's place
  in the message (NCCL's ring starts each chunk's sum at another rank).
A path that summed a weight in any other way than the others would change its scale in the
last bits, and the losses after the resume. The test first checks that the two emulations
do change sums of these weights (else it would prove nothing).

On GPUs the same check is ``tools/resume_check.sh`` (docs/bitnet.md, Resuming).
"""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import run_on_gloo

WORLD = 4
DIM, HIDDEN = 64, 96
STEPS, SAVE_AT = 6, 3


class _FeedForward(nn.Module):
    """llama's feed-forward, w2(silu(w1 x) * w3 x), twice (four BitNet layers per block
    group: the stacked sums hold more elements than the ranks)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            w1=nn.Linear(DIM, HIDDEN, bias=False), w3=nn.Linear(DIM, HIDDEN, bias=False),
            w2=nn.Linear(HIDDEN, DIM, bias=False))) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = x + b["w2"](F.silu(b["w1"](x)) * b["w3"](x))
        return x


def _chunked_l1(t: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """sum |t| as fp32 partial sums of fixed chunks, then the partials last to first: an
    order of its own, which depends on the tensor alone (as CUDA's multi-tensor norm)."""
    a = t.detach().reshape(-1).abs().float()
    parts = [a[i:i + chunk].sum() for i in range(0, a.numel(), chunk)] or [a.sum()]
    total = torch.zeros((), dtype=torch.float32)
    for p in reversed(parts):
        total = total + p
    return total


def _emulate_gpu_orders(world: int):
    """Patch, in this process, torch's multi-tensor L1 norm and sum all-reduces to add in
    orders that differ from the CPU kernels' (module docstring). Returns the originals."""
    import torch.distributed as dist

    orig_norm, orig_all_reduce = torch._foreach_norm, dist.all_reduce

    def foreach_norm(tensors, ord=2, dtype=None):
        if ord != 1:
            return orig_norm(tensors, ord, dtype=dtype)
        return [_chunked_l1(t).to(dtype or t.dtype) for t in tensors]

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op != dist.ReduceOp.SUM or tensor.dtype != torch.float32 or async_op:
            return orig_all_reduce(tensor, op, group, async_op)
        n = dist.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(n)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        flat = torch.stack([p.reshape(-1) for p in parts])  # [ranks, elements]
        out = torch.empty_like(flat[0])
        for i in range(flat.shape[1]):  # element i: a ring from rank i % n
            acc = flat[i % n, i]
            for k in range(1, n):
                acc = acc + flat[(i + k) % n, i]
            out[i] = acc
        tensor.copy_(out.view_as(tensor))
        return None

    torch._foreach_norm, dist.all_reduce = foreach_norm, all_reduce
    return orig_norm, orig_all_reduce


def _scenarios(rank, ckpt_root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from titan_lowbit.bitnet import CONVERTERS, enable_tensor_parallel
    from titan_lowbit.config import LowBit
    from titan_lowbit.optim import LowBitAdamW

    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh1d = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    res = {}

    # The emulations must move the sums of these weights: a local sum that is not the
    # multi-tensor norm's, and a stacked sum over the ranks that is not the scalar one's.
    torch.manual_seed(rank)
    shards = [torch.randn(HIDDEN // 4, DIM) for _ in range(8)]
    res["local_orders_differ"] = any(
        not torch.equal(_chunked_l1(s), torch.linalg.vector_norm(s, 1, dtype=torch.float32))
        for s in shards)
    local = torch.stack([_chunked_l1(s) for s in shards])
    orig = _emulate_gpu_orders(WORLD)
    stacked = local.clone()
    dist.all_reduce(stacked)
    alone = [s.clone().view(1) for s in local]
    for s in alone:
        dist.all_reduce(s)
    res["rank_orders_differ"] = not torch.equal(stacked, torch.cat(alone))

    def build(kind, optimizer):
        conv = CONVERTERS["bitnet"](SimpleNamespace(lowbit=LowBit(bitnet_filter=[])),
                                    SimpleNamespace(tp_enabled=kind != "fsdp"))
        model = _FeedForward()
        conv.convert(model)
        if kind in ("tp", "fsdp_tp"):
            plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
            for b in model.blocks:
                parallelize_module(b, mesh2d["tp"], plan)
        if kind in ("fsdp", "fsdp_tp"):
            dp = mesh1d if kind == "fsdp" else mesh2d["dp"]
            for b in model.blocks:
                for name in ("w1", "w3", "w2"):
                    fully_shard(b[name], mesh=dp)
            fully_shard(model, mesh=dp)
        if kind in ("tp", "fsdp_tp"):
            enable_tensor_parallel(model, mesh2d["tp"])
        if optimizer == "AdamW8bit":
            opt = LowBitAdamW(model.parameters(), lr=1e-2, state_format="8bit",
                              block_size=16, min_quantized_numel=0)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return conv, model, opt

    def batch(kind, step):
        # One batch per data-parallel rank (TP ranks of one group see the same rows).
        dp_rank = {"fsdp": rank, "tp": 0, "fsdp_tp": mesh2d["dp"].get_local_rank()}[kind]
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        return torch.randn(8, DIM, generator=g)

    def train(kind, conv, model, opt, steps, save=None):
        losses = []
        for step in steps:
            loss = model(batch(kind, step)).square().mean()
            loss.backward()
            losses.append(float(loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()))
            opt.step()
            opt.zero_grad()
            conv.post_optimizer_hook([model])
            if save is not None and step == SAVE_AT:
                dcp.save({"model": get_model_state_dict(model),
                          "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=save)
        weights = [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
                   for p in model.parameters()]
        return losses, weights

    from types import SimpleNamespace
    for kind, optimizer in (("fsdp", "AdamW"), ("tp", "AdamW"), ("fsdp_tp", "AdamW"),
                            ("fsdp_tp", "AdamW8bit")):
        tag = f"{kind}_{optimizer}"
        ckpt = f"{ckpt_root}/{tag}"
        straight, w_straight = train(kind, *build(kind, optimizer), range(1, STEPS + 1), save=ckpt)
        conv, model, opt = build(kind, optimizer)
        # As torchtitan loads: DCP in place into the state dicts, then set into the model
        # and the optimizer (load_state_dict).
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        resumed, w_resumed = train(kind, conv, model, opt, range(SAVE_AT + 1, STEPS + 1))
        res[tag] = dict(straight=straight[SAVE_AT:], resumed=resumed,
                        weights_equal=all(torch.equal(a, b) for a, b in zip(w_straight, w_resumed)))
    torch._foreach_norm, dist.all_reduce = orig
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bitnet_resume")
    return run_on_gloo(functools.partial(_scenarios, ckpt_root=str(root / "ckpt")), WORLD,
                       root / "res.pt")


def test_the_emulated_gpu_orders_change_the_sums(results):
    assert results["local_orders_differ"]
    assert results["rank_orders_differ"]


@pytest.mark.parametrize("tag", ["fsdp_AdamW", "tp_AdamW", "fsdp_tp_AdamW", "fsdp_tp_AdamW8bit"])
def test_resumed_bitnet_run_continues_bit_for_bit(results, tag):
    r = results[tag]
    assert r["resumed"] == r["straight"], r
    assert r["weights_equal"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's multi-tensor norm")
def test_a_weights_abs_sum_does_not_depend_on_the_other_weights_on_gpu():
    """On a GPU (``python -m pytest tests/test_bitnet_resume.py -k gpu``): the property
    the one sum |W| rests on. CUDA's multi-tensor norm sums each tensor in an order of its
    own, so a weight's sum is the same bits alone (a layer's all-gather after a checkpoint
    load) as among all the others (the post-optimizer precompute), in any list order;
    a weight with gaps between its elements sums as its contiguous copy."""
    from titan_lowbit.bitnet import ops

    # FSDP shards of llama3 debug and 1B weights, and odd sizes (chunks cut mid-row).
    shapes = [(128, 256), (384, 256), (128, 768), (1024, 2048), (128, 2048), (2816, 2048),
              (1024, 5632), (100, 37), (3, 65537)]
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        ws = [(torch.randn(s, device="cuda") * 0.02).to(dtype) for s in shapes]
        many = ops.weight_abs_sums(ws)
        reversed_order = ops.weight_abs_sums(ws[::-1])[::-1]
        for w, s, r in zip(ws, many, reversed_order):
            assert torch.equal(ops.weight_abs_sums([w])[0], s), (w.shape, dtype)
            assert torch.equal(r, s), (w.shape, dtype)
        mixed = ops.weight_abs_sums([ws[0].float(), ws[1].t(), ws[2].to(torch.float16)])
        assert torch.equal(mixed[1], ops.weight_abs_sums([ws[1].t().contiguous()])[0])
        assert torch.equal(mixed[0], ops.weight_abs_sums([ws[0].float()])[0])
