"""What a failed DCP load means, said with the step folder.

An error from DCP's own load, after the files passed :mod:`checkpoint_verify` and the
layout :mod:`checkpoint_layout`, is re-raised as a :class:`CheckpointMismatch` naming the
setting where it is recognized (the data loader's dp degree, LowBitAdamW's own load checks,
model shapes or names), else as :class:`CheckpointNotLoaded`. Neither is labelled damage:
the files passed the checks.
"""

from __future__ import annotations

import os
import re
import traceback

from titan_lowbit.torchtitan.checkpoint_layout import (
    CheckpointMismatch,
    LOWBIT_OPTION,
    dataloader_advice,
)
from titan_lowbit.torchtitan.checkpoint_verify import VERIFY_ENV, other_steps


class CheckpointNotLoaded(RuntimeError):
    """DCP could not load a checkpoint whose files passed the checks, for a reason not
    recognized as a configuration mismatch; the message says what to try."""


def root_causes(err: BaseException) -> list[tuple[BaseException, list]]:
    """(exception, its stack frames) of what went wrong, looking inside DCP's
    CheckpointException (one per failed rank)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        return [(exc, list(trace or [])) for exc, trace in failures.values()]
    return [(err, traceback.extract_tb(err.__traceback__))]


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [repr(err)])[0]


def _from_lowbit_load(frames) -> bool:
    optim_dir = os.path.join("titan_lowbit", "optim", "")
    return any(optim_dir in frame.filename and frame.name in (
        "load_state_dict", "check_loadable", "_load", "check_group")
        for frame in frames)


def _optimizer_load_problem(cause: str) -> str:
    option = "[optimizer] name and [lowbit] block_size, weight_update and min_quantized_numel"
    m = re.search(r"saved with (\w+)=(.*?), this optimizer was built with \1=", cause)
    if m and m.group(1) in LOWBIT_OPTION:
        option = LOWBIT_OPTION[m.group(1)]
        if m.group(1) == "decoupled_weight_decay":
            decoupled = m.group(2) == "True"
            option += (f" (the checkpoint's optimizer was an {'AdamW' if decoupled else 'Adam'}* "
                       "one: AdamW* names decouple weight decay, Adam* names add it to the "
                       "gradient)")
    return (f"optimizer state: LowBitAdamW refused it: {cause}\n  Set {option} as when the "
            "checkpoint was written, or start the optimizer state afresh with "
            "--checkpoint.exclude_from_loading optimizer.")


def load_failure(checkpoint_id: str, err: BaseException, crc: bool = True) -> BaseException:
    """What to raise when DCP's load of a checkpoint whose files passed :func:`verify` and
    :func:`check_compatible` failed with ``err``: a CheckpointMismatch naming the setting
    where the cause is recognized, else a CheckpointNotLoaded. Never CheckpointDamaged."""
    problems = []
    for exc, frames in root_causes(err):
        cause = first_line(exc)
        if "dp_degree is inconsistent" in cause or cause.startswith(
                "Missing key in checkpoint state_dict: dataloader."):
            problem = (f"dataloader: {cause}\n  The checkpoint was written with another "
                       "data-parallel degree; " + dataloader_advice())
        elif isinstance(exc, ValueError) and _from_lowbit_load(frames):
            problem = _optimizer_load_problem(cause)
        elif re.match(r"(Size mismatch|Missing key in checkpoint state_dict|Unexpected key)",
                      cause):
            problem = (f"{cause}\n  The run's model or optimizer differs from the one that "
                       "wrote the checkpoint: resume with the [model] name, flavor and "
                       "converters, [optimizer] name and [lowbit] settings it was written with.")
        else:
            continue
        if problem not in problems:
            problems.append(problem)
    if problems:
        return CheckpointMismatch(
            f"checkpoint {checkpoint_id} does not match this run:\n  " + "\n  ".join(problems))
    folder, others = other_steps(checkpoint_id)
    checked = ("Its files passed the size and CRC-32 checks, so this is most likely a "
               "configuration that differs from the one that wrote it" if crc else
               f"Its files were checked for size only ({VERIFY_ENV}=size): run without that "
               "setting to check the tensor data's CRC-32 too; otherwise this is most likely a "
               "configuration that differs from the one that wrote it")
    return CheckpointNotLoaded(
        f"checkpoint {checkpoint_id} could not be loaded into this run:\n  "
        f"{first_line(root_causes(err)[0][0])}\n{checked} ([model] name, flavor and "
        "converters, [parallelism], [optimizer], [lowbit], [checkpoint] exclude_from_loading): "
        "resume with that configuration, or train with this one into a new --job.dump_folder. "
        + (f"If the configuration is the one that wrote it, resume from another checkpoint "
           f"with --checkpoint.load_step N (steps {others} in {folder})." if others else
           "The checkpoint is left as it is.")
    )


