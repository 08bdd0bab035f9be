"""A torchtitan 0.3 override for tests/test_torchtitan03.py's end-to-end runs: three of
titan_lowbit's optimizers in one container, so that one pair of Trainer runs (straight
and resumed) checks them together.

``--override.imports 'tests.v03_mixed_optimizers.muon_beside_adamw8bit={"weight_update":
"stochastic"}'`` (run from the repository root) takes the ready config's optimizer (torch's
AdamW for the small parameters, AdamW8bit for the matrices), passes it and the given
options through titan_lowbit's own ``lowbit_muon`` override (the matrices' group becomes
Muon8bit), then puts the attention matrices back under AdamW8bit with the ready config's
options: LowBitAdamW with fp32 states for norms and embeddings, AdamW8bit for the
attention, Muon8bit for the feed-forward matrices (the head by its inner AdamW).
"""

from dataclasses import replace

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.override import override

from titan_lowbit.torchtitan import v03

ATTENTION = r"\.attention\."


@override(target=OptimizersContainer.Config,
          description="titan_lowbit tests: AdamW8bit attention matrices beside a Muon group")
def muon_beside_adamw8bit(cfg: OptimizersContainer.Config, **muon_options) -> v03.LowBitOptimizersContainer.Config:
    (adamw8bit,) = [pg for pg in cfg.param_groups if pg.optimizer_name == "AdamW8bit"]
    new = v03.lowbit_muon(cfg, **muon_options)
    at = next(i for i, pg in enumerate(new.param_groups) if pg.optimizer_name != "AdamW")
    new.param_groups.insert(at, replace(adamw8bit, pattern=ATTENTION))
    return new
