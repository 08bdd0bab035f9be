"""What torchtitan 0.2.x prints for a training run, read back.

- :func:`step_losses`: the loss of every training step, as printed (compared exactly by
  the tests, ``tools/resume_check.sh`` and ``scripts/convergence.py``);
  :func:`validation_losses`: the validation loss of every validated step;
  :func:`final_train_loss`: a run's training loss at its end, as the reports compare it;
- :func:`parse_log`: torchtitan's per-step metrics line (``step: N  loss: L  grad_norm: G
  memory: X GiB(Y%)  tps: T ...``, from ``torchtitan/components/metrics.py``), per rank;
- :func:`summarize`: steady-state figures of a run (``scripts/scale_runs.py``,
  ``scripts/reshard_runs.py``); :func:`merge_rounds` and :func:`scale_table`: the rows
  and the markdown report of ``scripts/scale_runs.py``.

It is not part of the package (no packaged tool reads training logs): the scripts import
it from beside them, ``tools/resume_check.sh`` and the tests from ``scripts/``.
"""

from __future__ import annotations

import re
import statistics

ANSI = re.compile(r"\x1b\[[0-9;]*m")
RANK = re.compile(r"^\[(?:rank|default)(\d+)\]:")
STEP = re.compile(
    r"\bstep:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)\s+"
    r"memory:\s*(?P<gib>[0-9.]+)GiB\((?P<pct>[0-9.]+)%\)\s+tps:\s*(?P<tps>[0-9,]+)"
)
# The loss of a training step as torchtitan prints it, in any log format (colors off).
STEP_LOSS = re.compile(r"\bstep:\s*(\d+)\s+loss:\s*(-?[0-9.]+|nan|inf)")
VAL_LOSS = re.compile(r"validate step:\s*(\d+)\s+loss:\s*(-?[0-9.]+|nan|inf)")


def step_losses(text: str) -> dict[int, str]:
    """{step: loss as printed} for the training steps torchtitan logged (not validation)."""
    losses = {}
    for line in text.splitlines():
        if "validate" in line:
            continue
        if m := STEP_LOSS.search(line):
            losses[int(m.group(1))] = m.group(2)
    return losses


def validation_losses(text: str) -> dict[int, float]:
    """{step: validation loss} for the steps torchtitan validated (colors off)."""
    return {int(step): float(loss) for step, loss in VAL_LOSS.findall(text)}


def final_train_loss(losses: dict[int, float]) -> float:
    """The mean of the last 10% of the logged steps' losses (at least one): one step's loss
    is one batch's, too noisy to compare runs by."""
    tail = [losses[s] for s in sorted(losses)[-max(len(losses) // 10, 1):]]
    return sum(tail) / len(tail)


def parse_log(text: str) -> dict[int, dict[int, dict[str, float]]]:
    """{rank: {step: {loss, grad_norm, gib, pct, tps}}} from torchtitan's training-step
    lines (validation lines are skipped). Lines without a ``[rankN]:`` prefix count as
    rank 0."""
    ranks: dict[int, dict[int, dict[str, float]]] = {}
    for line in text.splitlines():
        line = ANSI.sub("", line)
        if "validate step" in line or not (m := STEP.search(line)):
            continue
        r = RANK.match(line)
        rank = int(r.group(1)) if r else 0
        ranks.setdefault(rank, {})[int(m["step"])] = {
            "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
            "gib": float(m["gib"]), "pct": float(m["pct"]),
            "tps": float(m["tps"].replace(",", "")),
        }
    return ranks


def summarize(ranks: dict[int, dict[int, dict[str, float]]], warmup: int) -> dict | None:
    """Steady-state figures of one run: median tokens/s per GPU of rank 0's steps after
    the first ``warmup`` (torchtitan's tps is already per device), the peak reserved
    memory over every step and rank, and rank 0's last loss. None without any step."""
    if not ranks:
        return None
    first = ranks[min(ranks)]
    steps = sorted(first)
    steady = [first[s]["tps"] for s in steps if s > warmup] or [first[steps[-1]]["tps"]]
    peak = max((m for r in ranks.values() for m in r.values()),
               key=lambda m: (m["gib"], m["pct"]))
    return {
        "steps": len(steps), "last_step": steps[-1],
        "tps": statistics.median(steady), "tps_steps": len(steady),
        "peak_gib": peak["gib"], "peak_pct": peak["pct"],
        "loss": first[steps[-1]]["loss"],
        "losses": {s: first[s]["loss"] for s in steps},
    }


def merge_rounds(name: str, runs: list[dict], base: dict) -> dict:
    """One row per variant from its rounds: median tokens/s over the rounds that finished,
    peak memory over all of them, the first finished round's losses; a failure when no
    round finished (the first failure's text), a note when some did not."""
    done = [r for r in runs if r.get("tps")]
    seconds = round(sum(r.get("seconds", 0) for r in runs), 1)  # all rounds
    if not done:
        return {"variant": name, **base, "seconds": seconds, "failure": runs[0]["failure"]}
    row = {"variant": name, **base, **done[0], "seconds": seconds,
           "tps": statistics.median(r["tps"] for r in done),
           "tps_rounds": [r.get("tps") for r in runs]}
    row["peak_gib"], row["peak_pct"] = max((r["peak_gib"], r["peak_pct"]) for r in done)
    if failed := [r["failure"].splitlines()[0] for r in runs if not r.get("tps")]:
        row["failed_rounds"] = failed
    return row


def scale_table(rows: list[dict], header: list[str]) -> str:
    """The markdown report of ``scripts/scale_runs.py``: ``header`` lines, then one row per
    variant (``merge_rounds``), compared with the "fp32" row."""
    lines = [
        "| variant | GPUs | mesh | optimizer | weights / update | converters "
        "| peak GiB per GPU | tokens/s per GPU | vs fp32 AdamW | final loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = next((r for r in rows if r["variant"] == "fp32" and r.get("tps")), None)
    for r in rows:
        head = (f"| {r['variant']} | {r['ngpu']} | {r['mesh']} | {r['optimizer']} "
                f"| {r['weights']} | {r['converters']} ")
        if not r.get("tps"):
            tail = r["failure"].replace("|", "\\|").replace("\n", "<br>")
            lines.append(head + f"| failed | | | `{tail}` |")
            continue
        ratio = ""
        if base is not None:
            ratio = (f"memory {r['peak_gib'] / base['peak_gib']:.2f}x, "
                     f"tokens/s {r['tps'] / base['tps']:.3f}x")
        tps = f"{r['tps']:,.0f}"
        if len(r.get("tps_rounds", [])) > 1:
            tps += " (" + ", ".join(f"{t:,.0f}" if t else "failed" for t in r["tps_rounds"]) + ")"
        lines.append(head + f"| {r['peak_gib']:.2f} ({r['peak_pct']:.1f}%) | {tps} "
                            f"| {ratio} | {r['loss']:.4f} |")
    return "\n".join(header + [""] + lines) + "\n"
