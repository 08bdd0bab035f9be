"""``LowBitMuon``: Muon with a low-bit momentum for the matrices, low-bit AdamW for the rest.

Muon (Keller Jordan's optimizer) steps each 2-D hidden weight matrix with its momentum
orthogonalised by a quintic Newton-Schulz iteration; the update is scaled so that its RMS
matches AdamW's, by the rule of Moonshot AI's "Muon is Scalable for LLM Training" (arXiv
2502.16982): ``0.2 * sqrt(max(rows, cols))``, so Muon takes AdamW's learning rate and
weight decay (decoupled). The math, and why: ``titan_lowbit.kernels.muon_ref``.

The parameters Muon does not suit (``muon_groups``: not 2-D, embeddings, output head) are
stepped by a ``LowBitAdamW`` inside this optimizer: one AdamW update in the codebase.
Its param groups *are* this optimizer's AdamW groups (the same dicts), and its states are
this optimizer's states of those parameters (the same dicts), so an LR scheduler, a
``state_dict()`` and ``load_state_dict`` see one optimizer with one flat list of groups
and states, as torch and torch.distributed.checkpoint expect.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any, Iterable, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_lowbit.kernels.adamw_interface import UPDATE_NEAREST, WEIGHT_UPDATES
from titan_lowbit.kernels import muon_lowbit
from titan_lowbit.kernels.muon_ref import (
    MATCHED_RMS,
    NS_COEFFICIENTS,
    NS_STEPS,
    MuonConfig,
    MuonHyper,
    MuonTensor,
    finite,
    initial_col_factor,
    momentum_and_input,
    momentum_to_store,
    muon_step_reference,
    new_factor,
    new_weight,
    newton_schulz,
    write_step,
)
from titan_lowbit.fqn_fragments import selects
from titan_lowbit.kernels.quant_maps import tensor_key

from .adamw import LowBitAdamW
from .formats import param_format, weight_update_specs
from .group_options import NONFINITE_POLICIES, SKIPPED, check_param, checked_local_grad
from .hyperparams import hyper_value
from .master_start import take_start, write_start
from .muon_exchange import COLS, EXCHANGE_BUCKET_NUMEL, ROWS, Extra, OwnerExchange, exchange_buckets, split_dims
from .muon_groups import (
    DEFAULT_ADAMW_FQNS,
    DEFAULT_MOMENTUM_4BIT_FACTOR_RANK,
    DEFAULT_MOMENTUM_4BIT_LEVELS,
    MOMENTUM_4BIT_FACTOR_RANK,
    MOMENTUM_4BIT_LEVELS,
    MUON_FIXED_OPTIONS,
    MUON_ONLY_OPTIONS,
    SHARED_OPTIONS,
    UNRECORDED_MUON_OPTIONS,
    USE_MUON,
    check_4bit_options_asked,
    check_factor_param,
    check_muon_group,
    check_muon_param,
    factor_rank,
    momentum_codec,
    muon_fixed_value,
    suits_muon,
)
from .state_dict import EntrySpec, check_kind, check_param_state, load_with_checks, raise_value_problems
from .tensors import is_distributed, like_param, local

logger = logging.getLogger(__name__)

# LowBitAdamW's keyword defaults: the defaults of the options the two parts share.
_ADAMW_DEFAULTS = {k: v.default for k, v in inspect.signature(LowBitAdamW.__init__).parameters.items()
                   if v.default is not inspect.Parameter.empty}
# The momentum's state entry (torch.optim.Muon's name); quantized: "_codes" and "_absmax".
MOMENTUM = "momentum_buffer"
# The factor beside a 4-bit momentum (momentum_4bit_factor_rank): P [rows, k] and R
# [cols, k], and the parameter dimension each follows (its DTensor placements: P is
# sharded as the parameter's rows are, R as its columns).
ROW_FACTOR, COL_FACTOR = f"{MOMENTUM}_row_factor", f"{MOMENTUM}_col_factor"
FACTOR_DIMS = {ROW_FACTOR: 0, COL_FACTOR: 1}
# Stochastic-rounding keys of Muon's matrices: their position among the Muon parameters
# plus this, apart from the inner AdamW's keys (positions among its parameters).
_MUON_KEY_OFFSET = 1 << 30


class LowBitMuon(torch.optim.Optimizer):
    """Muon for the 2-D hidden weight matrices, ``LowBitAdamW`` for the other parameters.

    Args:
        params: ``model.named_parameters()`` (the names choose embeddings and the output
            head for AdamW, and appear in every error), parameters, or param groups
            (dicts). A group with ``use_muon=True`` (2-D parameters only) or
            ``use_muon=False`` is stepped as it says (the reference Muon's convention); a
            group without ``use_muon`` is split by shape and name: 2-D parameters whose
            name contains none of ``adamw_fqns`` go to Muon, the rest to AdamW (two
            groups, Muon's first). Unnamed parameters are split by shape alone.
        lr, weight_decay: of both parts (Moonshot's scale makes one lr fit both);
            decoupled weight decay.
        momentum, nesterov: Muon's momentum ``M <- momentum * M + (1 - momentum) * G``
            and its Nesterov look-ahead (the reference Muon's defaults).
        ns_steps, ns_coefficients: the quintic Newton-Schulz iteration (bf16).
        matched_rms: the RMS Muon's update is scaled to (Moonshot: 0.2, AdamW's typical).
        state_format: Muon's momentum and AdamW's moments: "fp32", "bf16", "8bit", "4bit"
            or "fp8" (``formats.STATE_FORMATS``; the momentum in the first-moment codec,
            but see ``momentum_4bit_levels``).
        momentum_4bit_levels: the levels of a "4bit" momentum: "nf4" (QLoRA's
            NormalFloat4; the default) or "dynamic" (the dynamic map of the "4bit"
            format's first moment, which its inner AdamW keeps). Other formats refuse a
            value but the default.
        momentum_4bit_factor_rank: k > 0: a "4bit" momentum keeps a bf16 factor P R^T of
            rank min(k, rows, cols) beside its codes, which hold only the residual; the
            factor is renewed from the new momentum at every step (one subspace iteration:
            two thin QRs and a few ``[rows, cols] x k`` products per matrix) and costs
            2 k (rows + cols) bytes per matrix (``kernels.muon_ref``). 0 (the default): no
            factor. Not yet for a matrix whose columns are split over ranks (tensor
            parallel): refused.
            Other formats refuse a value but 0.
        weight_update, block_size, min_quantized_numel, seed, nonfinite_grad: as in
            ``LowBitAdamW``, for both parts. ``nonfinite_grad="raise"``: a matrix whose
            new momentum or weight would hold an inf/nan keeps both unwritten and the step
            raises naming it after stepping the rest; "skip": checks every gradient
            first and skips the whole step (both parts); "ignore": no check.
        adamw_fqns: name fragments of the 2-D parameters that go to AdamW in groups
            without ``use_muon`` (default ``muon_groups.DEFAULT_ADAMW_FQNS``); each given
            fragment must select a parameter.
        adamw_options: more ``LowBitAdamW`` keywords for the AdamW part (``betas``,
            ``eps``, ``lr``, ...), over the shared ones above.
        exchange_bucket_numel: sharded matrices (FSDP2, HSDP, TP) are orthogonalised in
            buckets of at most this many elements (global; a larger matrix is a bucket of
            its own): each bucket is one exchange (``muon_exchange``), and what a step
            holds besides the states (the new momentum, the Newton-Schulz input and
            output, the old and new weight of each local shard, and the whole matrices
            this rank orthogonalises) is one bucket's.

    Every option of either part can be set per param group. ``state_dict()`` is torch's
    flat layout (one ``state`` entry per parameter, ``param_groups`` with ``use_muon``),
    plain tensors that ``torch.save``/``torch.load(weights_only=True)`` round-trip.

    Sharded parameters (DTensors: FSDP2's Shard(0), HSDP, tensor parallel's Shard(0) and
    Shard(1)) keep states that are DTensors placed like them, in the block layout of the
    whole matrix (a shard that would split a quantization block is refused at
    construction, naming the parameter); each sharded matrix is orthogonalised whole by
    one owner rank (``muon_exchange``), and the step gives the same bits as on one
    process holding the whole parameters.

    On CUDA the elementwise phases of each matrix (momentum dequantized, updated and
    requantized with the Newton-Schulz input written; the scaled update landed in the
    weight) run in fused Triton kernels (``kernels.muon_lowbit``), elsewhere in their
    PyTorch reference (``kernels.muon_ref``): the same math, bit for bit under Triton's
    interpreter.

    torchtitan reaches it through the Muon names
    (``titan_lowbit.optim.MUON_OPTIMIZERS``).
    """

    def __init__(self, params: Iterable[Any], lr: "float | torch.Tensor" = _ADAMW_DEFAULTS["lr"],
                 momentum: float = 0.95, weight_decay: float = _ADAMW_DEFAULTS["weight_decay"], *,
                 nesterov: bool = True, ns_steps: int = NS_STEPS,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, matched_rms: float = MATCHED_RMS,
                 momentum_4bit_levels: str = DEFAULT_MOMENTUM_4BIT_LEVELS,
                 momentum_4bit_factor_rank: int = DEFAULT_MOMENTUM_4BIT_FACTOR_RANK,
                 state_format: str = _ADAMW_DEFAULTS["state_format"],
                 weight_update: str = _ADAMW_DEFAULTS["weight_update"],
                 block_size: int = _ADAMW_DEFAULTS["block_size"],
                 min_quantized_numel: int = _ADAMW_DEFAULTS["min_quantized_numel"],
                 seed: int = _ADAMW_DEFAULTS["seed"], nonfinite_grad: str = _ADAMW_DEFAULTS["nonfinite_grad"],
                 adamw_fqns: Optional[Sequence[str]] = None, adamw_options: Optional[dict[str, Any]] = None,
                 exchange_bucket_numel: int = EXCHANGE_BUCKET_NUMEL):
        if nonfinite_grad not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite_grad={nonfinite_grad!r}: choose one of {NONFINITE_POLICIES}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r}: use a non-negative int")
        if isinstance(adamw_fqns, str):
            raise ValueError(f"adamw_fqns={adamw_fqns!r}: use a list of name fragments, e.g. [{adamw_fqns!r}]")
        adamw_options = dict(adamw_options or {})
        own = sorted(k for k in adamw_options if k in ("params", "seed", "nonfinite_grad") or k in MUON_ONLY_OPTIONS)
        unknown = sorted(k for k in adamw_options if k not in _ADAMW_DEFAULTS)
        if own or unknown:
            raise ValueError(f"adamw_options {own or unknown}: " + (
                "set these on LowBitMuon itself (they are the whole optimizer's or Muon's)" if own else
                f"not LowBitAdamW keywords; it takes {sorted(_ADAMW_DEFAULTS)}"))
        check_4bit_options_asked({MOMENTUM_4BIT_LEVELS: momentum_4bit_levels,
                                  MOMENTUM_4BIT_FACTOR_RANK: momentum_4bit_factor_rank}, state_format, "LowBitMuon")
        if isinstance(exchange_bucket_numel, bool) or not isinstance(exchange_bucket_numel, int) \
                or exchange_bucket_numel < 1:
            raise ValueError(f"exchange_bucket_numel={exchange_bucket_numel!r}: use an int >= 1 (elements)")
        self.seed = seed
        self.nonfinite_grad = nonfinite_grad
        self.exchange_bucket_numel = exchange_bucket_numel
        # Sharded matrices' exchanges, built (a collective) by the first step of a set of
        # parameters with gradients: (their keys, [(positions, OwnerExchange)]).
        self._exchanges: Optional[tuple[tuple, list]] = None
        self.adamw_fqns = tuple(DEFAULT_ADAMW_FQNS if adamw_fqns is None else adamw_fqns)
        self._adamw_kwargs = dict(lr=lr, weight_decay=weight_decay, state_format=state_format,
                                  weight_update=weight_update, block_size=block_size,
                                  min_quantized_numel=min_quantized_numel, seed=seed, nonfinite_grad=nonfinite_grad,
                                  **adamw_options)
        self._adamw: Optional[LowBitAdamW] = None  # made with the first AdamW group
        self._names: dict[torch.Tensor, str] = {}  # Muon's parameters (the inner AdamW names its own)
        self._order: dict[torch.Tensor, int] = {}
        self._fixed: list[Optional[tuple]] = []  # per group: Muon's MUON_FIXED_OPTIONS, None for AdamW's
        self._master_pending: set[torch.Tensor] = set()  # as LowBitAdamW._take_masters
        self._master_offered: dict[torch.Tensor, torch.Tensor] = {}  # as LowBitAdamW.start_masters_from
        self._all_names: list[str] = []
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=ns_coefficients, matched_rms=matched_rms,
                        momentum_4bit_levels=momentum_4bit_levels,
                        momentum_4bit_factor_rank=momentum_4bit_factor_rank, weight_decay=weight_decay,
                        state_format=state_format, weight_update=weight_update, block_size=block_size,
                        min_quantized_numel=min_quantized_numel)
        super().__init__(params, defaults)
        if adamw_fqns is not None:
            if not self._all_names:
                raise ValueError("adamw_fqns selects parameters by name: pass model.named_parameters() (or "
                                 "groups of (name, parameter) pairs), or mark groups with use_muon instead")
            unmatched = [f for f in self.adamw_fqns if not any(selects(n, (f,)) for n in self._all_names)]
            if unmatched:
                raise ValueError(f"adamw_fqns {unmatched} select no parameter (a fragment selects every name "
                                 f"that contains it; names look like {self._all_names[:6]}); fix or remove them")

    def start_masters_from(self, masters: "dict[torch.Tensor, torch.Tensor]") -> None:
        """As ``LowBitAdamW.start_masters_from``, for the Muon matrices and the parameters
        of the inner AdamW alike."""
        rest = {}
        for p, master in masters.items():
            if p not in self._names:
                rest[p] = master
                continue
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            self._master_offered[p] = write_start(p, group, self.state[p], master, self._names[p])
            self._master_pending.add(p)
        if rest:
            if self._adamw is None:
                raise ValueError(f"start_masters_from: {len(rest)} parameters are not in this optimizer; give "
                                 "master weights only for its own parameters")
            self._adamw.start_masters_from(rest)

    @property
    def adamw(self) -> Optional[LowBitAdamW]:
        """The LowBitAdamW that steps the AdamW groups (None while there are none)."""
        return self._adamw

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient (``nonfinite_grad="skip"``), kept in
        every param group so checkpoints carry it."""
        return max((g[SKIPPED] for g in self.param_groups), default=0)

    @skipped_steps.setter
    def skipped_steps(self, count: int) -> None:
        for group in self.param_groups:
            group[SKIPPED] = count

    def __getstate__(self) -> dict[str, Any]:
        """All of this optimizer (its inner AdamW, the names, the fixed options), so a
        ``copy.deepcopy`` or a pickle steps like the original; torch's own keeps only
        defaults, state and param_groups. Torch's hooks are left behind."""
        own = {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_")}
        own["_exchanges"] = None  # process groups: rebuilt by the next step
        return {**own, **super().__getstate__()}

    # ------------------------------------------------------------------------------------
    # groups and state
    # ------------------------------------------------------------------------------------
    def _is_muon(self, gi: int) -> bool:
        return self._fixed[gi] is not None

    def muon_params(self) -> list[torch.Tensor]:
        return [p for gi, g in enumerate(self.param_groups) if self._is_muon(gi) for p in g["params"]]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: as it says (``use_muon``), or split by shape and name into a Muon
        and an AdamW group. Validated whole first; on any error nothing was added."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        options = {k: v for k, v in param_group.items() if k not in ("params", "param_names")}
        params, names = _params_and_names(param_group)
        self._check_new_params(params, names)
        count = self.skipped_steps
        if options.pop(SKIPPED, count) != count:
            raise ValueError(f"{SKIPPED}={param_group[SKIPPED]!r} in a new param group, but this optimizer "
                             f"skipped {count} steps; it is the optimizer's own count: remove it")
        if USE_MUON in options:
            if not isinstance(options[USE_MUON], bool):
                raise ValueError(f"{USE_MUON}={options[USE_MUON]!r}; use True (Muon) or False (AdamW)")
            parts = [(options[USE_MUON], list(range(len(params))))]
            wrong = MUON_ONLY_OPTIONS if not options[USE_MUON] else [
                k for k in _ADAMW_DEFAULTS if k not in SHARED_OPTIONS and k not in ("seed", "nonfinite_grad")]
            given = sorted(k for k in options if k in wrong)
            if given:
                raise ValueError(f"a param group with {USE_MUON}={options[USE_MUON]} sets {given}, options of "
                                 f"{'Muon' if not options[USE_MUON] else 'AdamW'} only, which its parameters "
                                 "would never use: remove them")
        else:
            muon = [suits_muon(p, None if names is None else names[i], self.adamw_fqns) for i, p in enumerate(params)]
            parts = [(flag, [i for i, m in enumerate(muon) if m == flag]) for flag in (True, False)]
            parts = [(flag, idx) for flag, idx in parts if idx]
        muon_options = {k: v for k, v in options.items() if k not in _ADAMW_DEFAULTS or k in SHARED_OPTIONS}
        adamw_options = {k: v for k, v in options.items() if k not in MUON_ONLY_OPTIONS}

        gi = len(self.param_groups)
        muon_group = None
        for flag, idx in parts:  # the Muon part is checked before anything changes
            if flag:
                muon_group = {**self.defaults, **muon_options, USE_MUON: True, SKIPPED: count,
                              "params": [params[i] for i in idx]}
                check_4bit_options_asked(muon_options, muon_group["state_format"], f"param group {gi}")
                if names is not None:
                    muon_group["param_names"] = [names[i] for i in idx]
                check_muon_group(muon_group, f"param group {gi}")
                for pi, p in enumerate(muon_group["params"]):
                    name = self._param_name(gi, pi, p, muon_group)
                    check_muon_param(p, name)
                    check_param(p, muon_group, name, "LowBitMuon")
                    check_factor_param(p, factor_rank(p, param_format(p, muon_group)[0], muon_group), name)
        adamw_idx = next((idx for flag, idx in parts if not flag), None)
        if adamw_idx is not None:  # LowBitAdamW checks it and adds it whole, or not at all
            sub = {**adamw_options, USE_MUON: False,
                   "params": [params[i] if names is None else (names[i], params[i]) for i in adamw_idx]}
            if self._adamw is None:
                self._adamw = LowBitAdamW([sub], **self._adamw_kwargs)
                self._adamw.skipped_steps = count
            else:
                self._adamw.add_param_group(sub)
        if muon_group is not None:
            self._add_muon_group(muon_group)
        if adamw_idx is not None:
            self.param_groups.append(self._adamw.param_groups[-1])
            self._fixed.append(None)
            for p in self.param_groups[-1]["params"]:
                self.state[p] = self._adamw.state[p]
        self._all_names.extend(names or ())

    def _param_name(self, gi: int, pi: int, p: torch.Tensor, group: dict[str, Any]) -> str:
        names = group.get("param_names")
        return names[pi] if names else f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"

    def _check_new_params(self, params: list[torch.Tensor], names: Optional[list[str]]) -> None:
        """What torch's add_param_group checks across groups: tensors, leaves, each
        parameter once, names for all groups or none."""
        if self.param_groups and (names is not None) != ("param_names" in self.param_groups[0]):
            raise ValueError("all param groups must have parameter names, or none: name the parameters "
                             "of every group (model.named_parameters()) or of none")
        have = {p for g in self.param_groups for p in g["params"]}
        seen: set[torch.Tensor] = set()
        for i, p in enumerate(params):
            what = f"param '{names[i]}'" if names else f"parameter {i} of the new param group"
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{what} is a {type(p).__name__}; the optimizer steps tensors")
            if not p.is_leaf and not p.retains_grad:
                raise ValueError(f"{what} is not a leaf tensor; the optimizer steps leaves (parameters)")
            if p in have or p in seen:
                raise ValueError(f"{what} is listed twice (in this or another param group); list each "
                                 "parameter once")
            seen.add(p)

    def _add_muon_group(self, group: dict[str, Any]) -> None:
        gi = len(self.param_groups)
        self.param_groups.append(group)
        self._fixed.append(tuple(group[k] for k in MUON_FIXED_OPTIONS))
        for pi, p in enumerate(group["params"]):
            self._names[p] = self._param_name(gi, pi, p, group)
            self._order[p] = len(self._order)
            state = self.state[p]
            for key, (shape, dtype, gshape) in muon_state_specs(p, group).items():
                state[key] = like_param(p, torch.zeros(shape, dtype=dtype, device=local(p).device), gshape,
                                        muon_state_placements(p, key))
            if COL_FACTOR in state:
                rank, col0 = local(state[COL_FACTOR]).shape[1], _local_offset(p)[1]
                start = initial_col_factor(p.shape[1], rank, self._matrix_key(p))
                local(state[COL_FACTOR]).copy_(start[col0:col0 + local(p).shape[1]])
            if "master" in state:
                local(state["master"]).copy_(local(p).detach())
                self._master_pending.add(p)
            state["step"] = torch.tensor(0.0)

    def state_bytes_per_param(self) -> float:
        """Optimizer-state bytes per parameter element, both parts (local shards; ``step``
        excluded)."""
        nbytes = numel = 0
        for p in self.muon_params():
            numel += local(p).numel()
            nbytes += sum(local(v).numel() * v.element_size() for k, v in self.state[p].items() if k != "step")
        if self._adamw is not None:
            n = sum(local(p).numel() for g in self._adamw.param_groups for p in g["params"])
            nbytes += self._adamw.state_bytes_per_param() * n
            numel += n
        return nbytes / max(numel, 1)

    # ------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------
    def _check_groups(self) -> None:
        """Validate every Muon group before the step touches anything (a scheduler or user
        code may have changed one); the AdamW groups are checked by LowBitAdamW's step."""
        for gi, group in enumerate(self.param_groups):
            if group.get(USE_MUON) is not self._is_muon(gi):
                raise ValueError(f"param group {gi}: {USE_MUON} was changed to {group.get(USE_MUON)!r} after the "
                                 "group was added; set it back (build a new optimizer to move parameters)")
            if not self._is_muon(gi):
                continue
            check_muon_group(group, f"param group {gi}")
            fixed = tuple(group[k] for k in MUON_FIXED_OPTIONS)
            if fixed != self._fixed[gi]:
                k, was, now = next((k, a, b) for k, a, b in zip(MUON_FIXED_OPTIONS, self._fixed[gi], fixed) if a != b)
                raise ValueError(f"param group {gi}: {k} was changed from {was!r} to {now!r} after the group's "
                                 f"optimizer states were created, which fixed it; set it back, or build a new "
                                 f"optimizer with {k}={now!r}")

    def _check_grad(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        name = self._names[p]
        g = checked_local_grad(p, name, "LowBitMuon")
        loc = local(p)
        have = {k: (tuple(local(v).shape), v.dtype) for k, v in self.state[p].items() if k != "step"}
        want = {k: (shape, dtype) for k, (shape, dtype, _) in muon_state_specs(p, group).items()}
        if have != want:
            raise ValueError(f"param '{name}' is now {p.dtype} of (local) shape {tuple(loc.shape)}, which its "
                             f"optimizer state does not fit (it holds {have}, it needs {want}); no parameter was "
                             "stepped. Build a new optimizer for the changed model")
        return g

    def _muon_work(self) -> list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]:
        """(group, parameter, checked gradient) of every Muon parameter with a gradient."""
        return [(group, p, self._check_grad(p, group))
                for gi, group in enumerate(self.param_groups) if self._is_muon(gi)
                for p in group["params"] if p.grad is not None]

    # Run eagerly under torch.compile (a graph break), as LowBitAdamW's step.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = None if closure is None else closure()
        self._check_groups()
        work = self._muon_work()
        if self.nonfinite_grad == "skip":
            bad = self._nonfinite_muon_grad(work)
            if bad is None and self._adamw is not None:
                bad = self._adamw.find_nonfinite_grad()
            if bad is not None:
                self.skipped_steps = self.skipped_steps + 1
                logger.warning(f"LowBitMuon: skipped a step with a non-finite gradient, in "
                               f"{f'param {bad!r}' if bad else 'a parameter on another rank'} "
                               f"({self.skipped_steps} skipped so far)")
                return loss
            if self._adamw is not None:
                self._adamw.grads_checked = True
        if self._adamw is not None:
            self._adamw.step()
        guarded = self.nonfinite_grad != "ignore"
        matrices = [self._matrix(group, p) for group, p, _ in work]
        ok: list = [True] * len(work)
        for i, ((_, p, g), (cfg, tensor, hyper)) in enumerate(zip(work, matrices)):
            if split_dims(p, self._names[p]):
                continue
            # the whole matrix is here
            if not self._use_fused(tensor.param):
                ok[i] = muon_step_reference(cfg, tensor, g, hyper, guarded=guarded)
                continue
            flag = torch.zeros(1, dtype=torch.int32, device=tensor.param.device) if guarded else None
            muon_lowbit.muon_step_fused(cfg, tensor, g, hyper, flag)
            ok[i] = True if flag is None else flag  # read below, once every matrix is launched
        for idx, exchange in self._sharded(work):
            steps = [work[i] for i in idx]
            step = self._step_sharded_fused if self._use_fused(local(steps[0][1])) else self._step_sharded
            for i, good in zip(idx, step(exchange, steps, [matrices[i] for i in idx], guarded)):
                ok[i] = good
        ok = [not bool(x.item()) if isinstance(x, torch.Tensor) else x for x in ok]
        for _, p, _ in work:
            self.state[p]["step"] += 1
        failed = [self._names[p] for (_, p, _), good in zip(work, ok) if not good]
        if failed:
            raise FloatingPointError(
                f"a non-finite gradient or update in param '{failed[0]}'"
                + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
                + f" at optimizer step {int(self.state[work[0][1]]['step'])}: its weight and momentum were left "
                "as they were, the rest of the model took the step. Fix the loss scale / learning rate (or load "
                "a good checkpoint) and resume, or build the optimizer with nonfinite_grad='skip'")
        return loss

    def _nonfinite_muon_grad(self, work: list) -> Optional[str]:
        """The name of a Muon parameter with an inf/nan gradient, '' if only another rank
        has one (sharded parameters: every rank takes the same decision), None if none has."""
        bad = next((self._names[p] for _, p, g in work if not bool(torch.isfinite(g).all())), None)
        params = [p for _, p, _ in work]
        if is_distributed(params):
            dev = torch.device("cpu") if torch.distributed.get_backend() == "gloo" else local(params[0]).device
            flag = torch.tensor([0 if bad is None else 1], dtype=torch.int32, device=dev)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            if bad is None and int(flag.item()):
                return ""
        return bad

    def _matrix(self, group: dict[str, Any], p: torch.Tensor) -> tuple[MuonConfig, MuonTensor, MuonHyper]:
        """The reference step's view of Muon matrix ``p`` (its master weights taken now if
        pending, as LowBitAdamW does: weights loaded after construction count)."""
        state = self.state[p]
        if p in self._master_pending:
            take_start(p, state, self._master_offered)
            self._master_pending.discard(p)
        cfg, tensor = muon_tensor(p, group, state, self._matrix_key(p))
        where = f"param group of '{self._names[p]}'"
        hyper = MuonHyper(lr=hyper_value(where, "lr", group["lr"]),
                          momentum=hyper_value(where, "momentum", group["momentum"]),
                          weight_decay=hyper_value(where, "weight_decay", group["weight_decay"]),
                          ns_steps=group["ns_steps"], ns_coefficients=tuple(map(float, group["ns_coefficients"])),
                          matched_rms=hyper_value(where, "matched_rms", group["matched_rms"]),
                          step=int(state["step"]) + 1)
        return cfg, tensor, hyper

    def _matrix_key(self, p: torch.Tensor) -> int:
        """Muon matrix ``p``'s key (stochastic rounding, its factor's start): the seed and
        its position among the Muon matrices."""
        return tensor_key(self.seed, _MUON_KEY_OFFSET + self._order[p])

    def _sharded(self, work: list) -> list[tuple[list[int], OwnerExchange]]:
        """The exchanges of this step's sharded matrices, with their positions in ``work``;
        built when the set of sharded matrices with gradients changes (a collective: every
        rank of their meshes steps the same parameters)."""
        items = [(i, p, split_dims(p, self._names[p])) for i, (_, p, _) in enumerate(work)]
        items = [(i, p, dims) for i, p, dims in items if dims]
        key = (self.exchange_bucket_numel, *(id(p) for _, p, _ in items))
        if self._exchanges is None or self._exchanges[0] != key:
            built, loads = [], {}  # loads: elements owned per position, per mesh, over its buckets
            for positions, dims in exchange_buckets([(p, dims) for _, p, dims in items], self.exchange_bucket_numel):
                first = items[positions[0]][1]
                load = loads.setdefault((first.device_mesh, dims), [0] * math.prod(first.device_mesh.size(d)
                                                                                  for d in dims))
                built.append(([items[k][0] for k in positions],
                              OwnerExchange([items[k][1] for k in positions], dims, load=load)))
            self._exchanges = (key, built)
        return self._exchanges[1]

    @staticmethod
    def _step_sharded(exchange: OwnerExchange, work: list, matrices: list, guarded: bool) -> list[bool]:
        """Step one bucket of sharded matrices: the elementwise phases of the reference on
        each local shard, Newton-Schulz on the whole matrix at its owner; returns per
        matrix whether it was written (the non-finite guard decides on every shard's
        values, on every rank alike)."""
        _place_shards(exchange, work, matrices)
        extras = _factor_extras(matrices)
        moments, inputs, side = [], [], []
        for (_, p, g), (cfg, tensor, hyper) in zip(work, matrices):
            m, u = momentum_and_input(cfg, tensor, g, hyper)
            moments.append(m)
            inputs.append(u.to(exchange.wire_dtype))  # what travels, rounded now: the fp32 copy is not kept
            if extras is not None:  # the owner's new factor comes from the new momentum, in bf16
                side.append((m if cfg.factor_rank else u).to(exchange.wire_dtype))
        outputs, factors = exchange.run(inputs, _orthogonaliser(matrices), side if extras else None, extras)
        del inputs, side
        weights = [new_weight(cfg, tensor, o, hyper, tuple(p.shape))
                   for (_, p, _), (cfg, tensor, hyper), o in zip(work, matrices, outputs)]
        stored = [momentum_to_store(m, factor or None) for m, factor in zip(moments, factors)]
        ok = [True] * len(work)
        if guarded:
            ok = exchange.all_finite(torch.stack([finite(m, p_new, s) for m, (_, p_new), s in
                                                  zip(moments, weights, stored)]))
            ok = ok.tolist()
        for good, s, (p_old, p_new), (cfg, tensor, hyper), factor in zip(ok, stored, weights, matrices, factors):
            if good:
                write_step(cfg, tensor, s, p_old, p_new, hyper, factor or None)
        return ok

    @staticmethod
    def _step_sharded_fused(exchange: OwnerExchange, work: list, matrices: list, guarded: bool) -> list[bool]:
        """``_step_sharded`` in the fused kernels (``kernels.muon_lowbit``): the momentum
        kernel on each local shard (guarded: the new momentum staged), Newton-Schulz at the
        owners, the weight kernel's CHECK launch, the flags agreed over the matrices'
        ranks, the WRITE launch (which commits the staged momentum)."""
        _place_shards(exchange, work, matrices)
        flags = torch.zeros(len(work), dtype=torch.int32, device=exchange.device) if guarded else None
        extras = _factor_extras(matrices)
        staged, inputs, side = [], [], []
        for j, ((_, p, g), (cfg, tensor, hyper)) in enumerate(zip(work, matrices)):
            flag = None if flags is None else flags[j:j + 1]
            if cfg.factor_rank:  # the INPUT launch: the state is stored once the new factor is back
                u, mw = muon_lowbit.factored_input(cfg, tensor, g, hyper, (tensor.row_factor, tensor.col_factor),
                                                   flag)
                stage = None
            else:
                (u, stage), mw = muon_lowbit.momentum_and_input(cfg, tensor, g, hyper, flag), None
            inputs.append(u)
            staged.append(stage)
            if extras is not None:
                side.append(u if mw is None else mw)
        outputs, factors = exchange.run(inputs, _orthogonaliser(matrices), side if extras else None, extras)
        del inputs, side
        for j, ((_, p, g), (cfg, tensor, hyper), factor) in enumerate(zip(work, matrices, factors)):
            if factor:  # the STORE launch
                staged[j] = muon_lowbit.store_factored(cfg, tensor, g, hyper, (tensor.row_factor, tensor.col_factor),
                                                       factor, None if flags is None else flags[j:j + 1])
        if guarded:
            for j, ((_, p, _), (cfg, tensor, hyper), o) in enumerate(zip(work, matrices, outputs)):
                muon_lowbit.check_weight(cfg, tensor, o, hyper, tuple(p.shape), flags[j:j + 1])
            flags.copy_((~exchange.all_finite(flags == 0)).to(torch.int32))
        for j, ((_, p, _), (cfg, tensor, hyper), o) in enumerate(zip(work, matrices, outputs)):
            flag = None if flags is None else flags[j:j + 1]
            muon_lowbit.write_weight(cfg, tensor, o, hyper, tuple(p.shape), flag, staged[j])
            if factors[j]:
                muon_lowbit.commit_factor(tensor, factors[j], flag)
        return [True] * len(work) if flags is None else (flags == 0).tolist()

    # The fused Triton kernels where LowBitAdamW runs its own (CUDA tensors), the PyTorch
    # reference elsewhere.
    _use_fused = staticmethod(LowBitAdamW._use_fused)

    def check_nonfinite(self) -> None:
        """The AdamW part's pending non-finite check (``LowBitAdamW.check_nonfinite``);
        the Muon part raises in the step itself."""
        if self._adamw is not None:
            self._adamw.check_nonfinite()

    # ------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict (after the AdamW part's pending non-finite checks)."""
        self.check_nonfinite()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load like torch (its hooks run in its order), but check everything first and on
        any error leave the optimizer as it was: the Muon groups' states here, the AdamW
        groups' by ``LowBitAdamW.load_state_dict`` (the same checks as alone). The fixed
        options must match; the hyperparameters are restored from the state dict."""
        if not (isinstance(state_dict, dict) and "state" in state_dict and "param_groups" in state_dict):
            raise ValueError("LowBitMuon.load_state_dict needs an optimizer state dict with 'state' and "
                             "'param_groups' (from LowBitMuon.state_dict())")
        checked: dict[str, Any] = {}
        before = (self.state, self.param_groups, self._master_pending)

        def check(sd: dict[str, Any]) -> None:
            checked["muon"], checked["adamw"] = self._check_loadable(sd)
            checked["skipped"] = max((g.get(SKIPPED, 0) for g in sd["param_groups"]), default=0)

        def restore() -> None:
            self.state, self.param_groups, self._master_pending = before

        load_with_checks(self, state_dict, check, lambda: self._load(before, checked), restore)

    def _check_loadable(self, sd: dict[str, Any]) -> tuple[list, Optional[dict[str, Any]]]:
        """Raise before anything changes when ``sd`` does not fit; else (parameter, loaded
        Muon state, step) per Muon parameter, and the AdamW groups' state dict."""
        saved = sd["param_groups"]
        if [len(g.get("params", ())) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"the state dict has param groups of {[len(g.get('params', ())) for g in saved]} "
                             f"parameters, this optimizer of {[len(g['params']) for g in self.param_groups]}: build "
                             "the optimizer with the param groups the state dict was saved with")
        known = {i for g in saved for i in g["params"]}
        unknown = [k for k in sd["state"] if k not in known]
        if unknown:
            raise ValueError(f"the state dict holds state for parameter ids {unknown[:5]} that no param group lists")
        loaded, checks, where, adamw_groups = [], [], [], []
        for gi, (s, group) in enumerate(zip(saved, self.param_groups)):
            if s.get(USE_MUON) is not self._is_muon(gi):
                raise ValueError(f"param group {gi} of the state dict has {USE_MUON}={s.get(USE_MUON)!r}, this "
                                 f"optimizer's {self._is_muon(gi)}: it was not saved by a LowBitMuon with these param "
                                 "groups; build the optimizer as it was built when the state dict was saved")
            if not self._is_muon(gi):
                adamw_groups.append(s)
                continue
            # UNRECORDED_MUON_OPTIONS may be unrecorded (muon_fixed_value says what that means)
            missing = [k for k in MUON_ONLY_OPTIONS + SHARED_OPTIONS if k not in s and k not in UNRECORDED_MUON_OPTIONS]
            if missing:
                raise ValueError(f"param group {gi} of the state dict has no {missing}: it was not saved by LowBitMuon")
            for k in MUON_FIXED_OPTIONS:
                was, now = muon_fixed_value(s, k), muon_fixed_value(group, k)
                if was != now:
                    saved = s[k] if k in s else was
                    raise ValueError(f"param group {gi}: the state dict was saved with {k}={saved!r}, this optimizer "
                                     f"was built with {k}={group[k]!r}. Build the optimizer with {k}={saved!r} to "
                                     "resume it, or start the optimizer state afresh")
            check_muon_group({**group, **s}, f"param group {gi} of the state dict")
            for key, p in zip(s["params"], group["params"]):
                name, state = self._names[p], sd["state"].get(key)
                if not state:
                    raise ValueError(f"param '{name}': the state dict holds no optimizer state for it; it is "
                                     "incomplete or not this optimizer's. Load a complete one")
                codec = momentum_codec(param_format(p, group)[0], group)
                specs = {k: EntrySpec(gshape, shape, dtype, check_kind(k), codec,
                                      muon_state_placements(p, k) if k in FACTOR_DIMS else None)
                         for k, (shape, dtype, gshape) in muon_state_specs(p, group).items()}
                own = next(iter(v for k, v in self.state[p].items() if k != "step"))
                loaded.append(check_param_state(p, name, state, specs, own if isinstance(own, DTensor) else None,
                                                group, checks, where))
        raise_value_problems(checks, where, is_distributed(self.muon_params()))
        adamw_ids = {i for g in adamw_groups for i in g["params"]}
        adamw_sd = None if not adamw_groups else {
            "state": {k: v for k, v in sd["state"].items() if k in adamw_ids}, "param_groups": adamw_groups}
        return loaded, adamw_sd

    def _load(self, before: tuple, checked: dict[str, Any]) -> None:
        """After torch's load (new group dicts, empty state): the AdamW part loaded by
        LowBitAdamW (its groups become this optimizer's again), the Muon states copied in,
        the Muon groups' fixed options kept as built."""
        self.state = before[0]
        if checked["adamw"] is not None:
            self._adamw.load_state_dict(checked["adamw"])
        adamw_groups = iter(self._adamw.param_groups if self._adamw is not None else ())
        for gi, group in enumerate(self.param_groups):
            if self._is_muon(gi):
                group.update(zip(MUON_FIXED_OPTIONS, self._fixed[gi]))
            else:
                self.param_groups[gi] = next(adamw_groups)
        self._master_pending = set(self._master_pending)
        for p, values, step in checked["muon"]:
            for key, value in values.items():
                dst, src = local(self.state[p][key]), local(value)
                if dst.data_ptr() != src.data_ptr() or dst.device != src.device:  # DCP loads in place
                    dst.copy_(src)
            self.state[p]["step"] = torch.tensor(step)
            self._master_pending.discard(p)  # a loaded master is kept
            self._master_offered.pop(p, None)
        self.skipped_steps = checked["skipped"]


def _place_shards(exchange: OwnerExchange, work: list, matrices: list) -> None:
    """Key each local shard's stochastic rounding by its elements' indices in the whole
    matrix (the shard's rectangle in the exchange), so shards round as the matrix does."""
    rects = exchange.rects[exchange.coord]
    for j, ((_, p, _), (_, tensor, _)) in enumerate(zip(work, matrices)):
        row0, col0 = rects[j][0], rects[j][1]
        tensor.sr_base, tensor.sr_row_stride = row0 * p.shape[1] + col0, p.shape[1]


def _orthogonaliser(matrices: list):
    """The owner's work on whole matrix ``j`` of a bucket: Newton-Schulz with its group's
    steps and coefficients, and for a momentum with a factor the new factor from the whole
    new momentum (the side matrix, bf16) and the old column factor, which every rank of a
    row-sharded matrix holds whole (``check_factor_param``)."""
    def orthogonalise(j: int, whole: torch.Tensor, side: Optional[torch.Tensor]) -> tuple[torch.Tensor, tuple]:
        cfg, tensor, hyper = matrices[j]
        o = newton_schulz(whole, hyper.ns_steps, hyper.ns_coefficients)
        if not cfg.factor_rank:
            return o, ()
        return o, new_factor(tensor.col_factor, side)

    return orthogonalise


def _factor_extras(matrices: list) -> Optional[list[tuple[Extra, ...]]]:
    """What the owners send back beside each matrix's result in a bucket where a momentum
    keeps a factor: its new P (by rows) and R (by columns), bf16; None where none does (the
    exchange then carries no side matrix). In such a bucket a matrix without a factor sends
    its input again as its side matrix, unused."""
    if not any(cfg.factor_rank for cfg, _, _ in matrices):
        return None
    return [(Extra(ROWS, t.row_factor.shape[1], torch.bfloat16), Extra(COLS, t.col_factor.shape[1], torch.bfloat16))
            if cfg.factor_rank else () for cfg, t, _ in matrices]


def _params_and_names(group: dict[str, Any]) -> tuple[list[torch.Tensor], Optional[list[str]]]:
    """A group's parameters and their names (from ``(name, parameter)`` pairs or
    ``param_names``), as torch's add_param_group reads them."""
    params = group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters must be an ordered collection (a list), not a set: the order "
                        "of a set changes between runs")
    params = list(params)
    named = [isinstance(p, tuple) for p in params]
    if any(named):
        if not all(named):
            raise ValueError("give every parameter of a group a name ((name, parameter) pairs), or none")
        return [p for _, p in params], [n for n, _ in params]
    names = group.get("param_names")
    if names is not None and len(names) != len(params):
        raise ValueError(f"param_names has {len(names)} names for {len(params)} parameters")
    return params, None if names is None else list(names)


def muon_state_specs(p: torch.Tensor, group: dict[str, Any]) -> dict[str, tuple]:
    """State tensor name -> (local shape, dtype, global shape) of a Muon matrix: its
    momentum in the group's format (first-moment codec, the block layout of ``formats``:
    a shard's blocks are the whole matrix's blocks of its rows), the factor beside a 4-bit
    momentum (bf16 P and R: the local rows and columns, ``factor_rank`` wide) and the extra
    state of its weight update."""
    fmt, block = param_format(p, group)
    shapes = fmt.moment_shapes(MOMENTUM, tuple(local(p).shape), block)
    gshapes = fmt.moment_shapes(MOMENTUM, tuple(p.shape), block)
    specs = {k: (shape, dtype, gshapes[k][0]) for k, (shape, dtype) in shapes.items()}
    rank = factor_rank(p, fmt, group)
    if rank:
        specs.update({key: ((local(p).shape[dim], rank), torch.bfloat16, (p.shape[dim], rank))
                      for key, dim in FACTOR_DIMS.items()})
    return {**specs, **weight_update_specs(p, group)}


def muon_state_placements(p: torch.Tensor, key: str) -> Optional[tuple]:
    """The DTensor placements of state ``key`` of a DTensor matrix ``p`` (None for a plain
    one): the parameter's, but for the factor (FACTOR_DIMS), whose rows are the parameter's
    rows (P) or columns (R): on each mesh dimension, sharded as that dimension of the
    parameter is (then along the factor's rows), replicated where the parameter is sharded
    along the other dimension or replicated."""
    if not isinstance(p, DTensor):
        return None
    if key not in FACTOR_DIMS:
        return tuple(p.placements)
    dim, placements = FACTOR_DIMS[key], []
    for pl in p.placements:
        if not isinstance(pl, (Shard, Replicate)):  # check_factor_param refuses these
            raise TypeError(f"the factor of a matrix placed {tuple(p.placements)}: Shard and Replicate only")
        placements.append(Shard(0) if isinstance(pl, Shard) and pl.dim % p.dim() == dim else Replicate())
    return tuple(placements)


def _local_offset(p: torch.Tensor) -> tuple[int, int]:
    """(row, column) of the whole matrix where ``p``'s local shard starts."""
    if not isinstance(p, DTensor):
        return 0, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1])


def muon_tensor(p: torch.Tensor, group: dict[str, Any], state: dict[str, Any],
                sr_key: int) -> tuple[MuonConfig, MuonTensor]:
    """The reference step's view of one Muon matrix (its local shard) and its state."""
    fmt, block = param_format(p, group)
    update = WEIGHT_UPDATES[group["weight_update"]] if p.dtype == torch.bfloat16 else UPDATE_NEAREST
    cfg = MuonConfig(codec=momentum_codec(fmt, group), state_bf16=fmt.plain_dtype == torch.bfloat16, block=block,
                     weight_update=update, nesterov=group["nesterov"], factor_rank=factor_rank(p, fmt, group))
    if fmt.quantized:
        momentum, scale = local(state[f"{MOMENTUM}_codes"]).view(torch.uint8), local(state[f"{MOMENTUM}_absmax"])
    else:
        momentum, scale = local(state[MOMENTUM]), None
    extra = state.get("master", state.get("kahan_comp", state.get("master_remainder")))
    factor = {"row_factor": local(state[ROW_FACTOR]), "col_factor": local(state[COL_FACTOR])} if cfg.factor_rank else {}
    return cfg, MuonTensor(param=local(p.data), momentum=momentum, momentum_scale=scale,
                           extra=None if extra is None else local(extra), sr_key=sr_key, **factor)
