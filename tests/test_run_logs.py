"""scripts/run_logs.py reads torchtitan 0.2.2's per-step log lines. The excerpts are real:
captured from `scripts/train.sh train_configs/llama3_debug.toml` on 2 gloo CPU processes
with LOG_RANK=0,1 (torchrun's warning lines left out), plain and in torchtitan's colors."""

from run_logs import parse_log, summarize  # scripts/run_logs.py (conftest puts scripts/ on the path)

# scripts/scale_runs.py --config train_configs/llama3_debug.toml --ngpu 2 --steps 4, "8bit"
PLAIN = (
    '[rank1]:[titan] 2026-11-22 17:57:56,920 - root - INFO - step:  1  loss:  8.12598  grad_norm:  0.6479  memory:  0.80GiB(3.39%)  tps: 42  tflops: 0.00  mfu: 0.00%\n'
    '[rank1]:[titan] 2026-11-22 17:57:56,921 - root - INFO - Synchronizing and adjusting timeout for all ProcessGroups to 0:01:40\n'
    '[rank0]:[titan] 2026-11-22 17:57:56,921 - root - INFO - step:  1  loss:  8.12598  grad_norm:  0.6479  memory:  0.80GiB(3.41%)  tps: 41  tflops: 0.00  mfu: 0.00%\n'
    '[rank0]:[titan] 2026-11-22 17:57:56,921 - root - INFO - Synchronizing and adjusting timeout for all ProcessGroups to 0:01:40\n'
    '[rank0]:[titan] 2026-11-22 17:58:01,665 - root - INFO - step:  2  loss:  7.90346  grad_norm:  0.6533  memory:  0.83GiB(3.52%)  tps: 216  tflops: 0.01  mfu: 0.00%\n'
    '[rank1]:[titan] 2026-11-22 17:58:01,665 - root - INFO - step:  2  loss:  7.90346  grad_norm:  0.6533  memory:  0.83GiB(3.51%)  tps: 216  tflops: 0.01  mfu: 0.00%\n'
    '[rank1]:[titan] 2026-11-22 17:58:04,051 - root - INFO - step:  3  loss:  7.40279  grad_norm:  0.7063  memory:  0.83GiB(3.51%)  tps: 429  tflops: 0.02  mfu: 0.01%\n'
    '[rank0]:[titan] 2026-11-22 17:58:04,051 - root - INFO - step:  3  loss:  7.40279  grad_norm:  0.7063  memory:  0.84GiB(3.55%)  tps: 429  tflops: 0.02  mfu: 0.01%\n'
    '[rank1]:[titan] 2026-11-22 17:58:07,479 - root - INFO - step:  4  loss:  6.84135  grad_norm:  3.0639  memory:  0.83GiB(3.52%)  tps: 299  tflops: 0.01  mfu: 0.00%\n'
    '[rank1]:[titan] 2026-11-22 17:58:07,480 - root - INFO - Process group destroyed\n'
    '[rank0]:[titan] 2026-11-22 17:58:07,479 - root - INFO - step:  4  loss:  6.84135  grad_norm:  3.0639  memory:  0.84GiB(3.57%)  tps: 299  tflops: 0.01  mfu: 0.00%\n'
    '[rank0]:[titan] 2026-11-22 17:58:07,480 - root - INFO - Sleeping 2 seconds for other ranks to complete\n'
)

# scripts/train.sh train_configs/llama3_debug.toml --training.steps 2 --validation.freq 2
COLORED = (
    '[rank1]:[titan] 2026-11-22 18:04:55,940 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss:  8.12598  \x1b[38;2;180;60;0mgrad_norm:  0.6479  \x1b[38;2;54;234;195mmemory:  0.79GiB(3.38%)  \x1b[34mtps: 355  \x1b[36mtflops: 0.01  \x1b[35mmfu: 0.00%\x1b[39m\n'
    '[rank0]:[titan] 2026-11-22 18:04:55,940 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss:  8.12598  \x1b[38;2;180;60;0mgrad_norm:  0.6479  \x1b[38;2;54;234;195mmemory:  0.78GiB(3.30%)  \x1b[34mtps: 364  \x1b[36mtflops: 0.01  \x1b[35mmfu: 0.00%\x1b[39m\n'
    '[rank1]:[titan] 2026-11-22 18:04:56,380 - root - INFO - \x1b[33mvalidate step:  1  \x1b[32mloss:  8.0286  \x1b[38;2;54;234;195mmemory:  0.79GiB(3.38%)  \x1b[34mtps: 2,329\x1b[39m\n'
    '[rank1]:[titan] 2026-11-22 18:04:56,381 - root - INFO - Synchronizing and adjusting timeout for all ProcessGroups to 0:01:40\n'
    '[rank0]:[titan] 2026-11-22 18:04:56,380 - root - INFO - \x1b[33mvalidate step:  1  \x1b[32mloss:  8.0286  \x1b[38;2;54;234;195mmemory:  0.78GiB(3.30%)  \x1b[34mtps: 2,328\x1b[39m\n'
    '[rank0]:[titan] 2026-11-22 18:04:56,381 - root - INFO - Synchronizing and adjusting timeout for all ProcessGroups to 0:01:40\n'
    '[rank1]:[titan] 2026-11-22 18:04:57,975 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss:  7.90346  \x1b[38;2;180;60;0mgrad_norm:  0.6533  \x1b[38;2;54;234;195mmemory:  0.83GiB(3.53%)  \x1b[34mtps: 642  \x1b[36mtflops: 0.02  \x1b[35mmfu: 0.01%\x1b[39m\n'
    '[rank0]:[titan] 2026-11-22 18:04:57,963 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss:  7.90346  \x1b[38;2;180;60;0mgrad_norm:  0.6533  \x1b[38;2;54;234;195mmemory:  0.83GiB(3.52%)  \x1b[34mtps: 647  \x1b[36mtflops: 0.02  \x1b[35mmfu: 0.01%\x1b[39m\n'
    '[rank1]:[titan] 2026-11-22 18:04:58,470 - root - INFO - \x1b[33mvalidate step:  2  \x1b[32mloss:  7.7097  \x1b[38;2;54;234;195mmemory:  0.83GiB(3.53%)  \x1b[34mtps: 2,071\x1b[39m\n'
    '[rank1]:[titan] 2026-11-22 18:04:58,472 - root - INFO - Process group destroyed\n'
    '[rank0]:[titan] 2026-11-22 18:04:58,468 - root - INFO - \x1b[33mvalidate step:  2  \x1b[32mloss:  7.7097  \x1b[38;2;54;234;195mmemory:  0.83GiB(3.52%)  \x1b[34mtps: 2,031\x1b[39m\n'
)


def test_parse_log_reads_every_rank_and_step():
    ranks = parse_log(PLAIN)
    assert sorted(ranks) == [0, 1] and sorted(ranks[0]) == [1, 2, 3, 4]
    assert ranks[0][4] == {"loss": 6.84135, "grad_norm": 3.0639, "gib": 0.84, "pct": 3.57,
                           "tps": 299.0}
    assert ranks[1][1]["tps"] == 42.0 and ranks[1][4]["gib"] == 0.83


def test_parse_log_strips_colors_and_skips_validation():
    ranks = parse_log(COLORED)
    assert sorted(ranks[0]) == [1, 2] and sorted(ranks[1]) == [1, 2]
    assert ranks[0][2]["loss"] == 7.90346 and ranks[0][2]["tps"] == 647.0  # not validation's
    assert ranks[1][1]["gib"] == 0.79


def test_summarize_takes_steady_state_and_peak_over_ranks():
    s = summarize(parse_log(PLAIN), warmup=1)
    assert s["tps"] == 299.0 and s["tps_steps"] == 3  # median of steps 2-4 on rank 0
    assert (s["peak_gib"], s["peak_pct"]) == (0.84, 3.57)  # rank 0, step 4
    assert s["loss"] == 6.84135 and s["last_step"] == 4 and s["losses"][1] == 8.12598
    assert summarize(parse_log("no step lines here"), warmup=1) is None


def test_parse_log_reads_thousands_and_wide_memory():
    line = ("[rank3]:[titan] 2026-11-22 18:04:57,963 - root - INFO - step: 12  loss:  9.81234  "
            "grad_norm:  1.2345  memory: 101.27GiB(72.85%)  tps: 4,321  tflops: 123.45  mfu: 12.49%")
    assert parse_log(line) == {3: {12: {"loss": 9.81234, "grad_norm": 1.2345, "gib": 101.27,
                                         "pct": 72.85, "tps": 4321.0}}}


def test_scale_runs_merges_rounds_into_one_row():
    from run_logs import merge_rounds, scale_table as table

    def run(tps, gib, loss):
        return {"seconds": 40.0, "steps": 4, "last_step": 4, "tps": tps, "tps_steps": 3,
                "peak_gib": gib, "peak_pct": gib, "loss": loss, "losses": {4: loss}}

    base = {"ngpu": 4, "mesh": "dp_shard 2 x tp 2", "optimizer": "AdamW8bit",
            "weights": "fp32", "converters": "none"}
    rounds = [run(4930.0, 32.0, 8.49), {"seconds": 5.0, "failure": "exit 1 after 5 s: boom"},
              run(5086.0, 32.5, 8.50)]
    row = merge_rounds("8bit", rounds, base)
    assert row["tps"] == 5008.0 and row["tps_rounds"] == [4930.0, None, 5086.0]
    assert row["peak_gib"] == 32.5 and row["loss"] == 8.49  # peak over rounds, first loss
    assert row["seconds"] == 85.0 and row["failed_rounds"] == ["exit 1 after 5 s: boom"]
    fp32 = merge_rounds("fp32", [run(5278.0, 42.75, 8.36), run(5286.0, 42.75, 8.36)], base)
    failed = merge_rounds("bitnet_8bit", [{"failure": "timed out after 120 s: x"}], base)
    assert "failure" in failed and "tps" not in failed
    text = table([fp32, row, failed], ["# t"])
    assert "| 5,282 (5,278, 5,286) | memory 1.00x, tokens/s 1.000x |" in text
    assert "| 5,008 (4,930, failed, 5,086) | memory 0.76x, tokens/s 0.948x |" in text
    assert "| failed | | | `timed out after 120 s: x` |" in text
