from autoresearch.harness import logfmt


def test_step_line_round_trip():
    line = logfmt.format_step(42, 14.0, 4.1234567, 1234567.8, 41.23, 0.312, 258.4)
    m = logfmt.STEP_RE.match(line)
    assert m and m["step"] == "00042" and m["loss"] == "4.123457" and m["mfu"] == "41.2%"
    assert logfmt.STEP_RE.match(logfmt.format_step(1, 0, 9.0, 10, None, 1.0, 20))["mfu"] == "unknown"


def test_a_step_lines_remaining_and_percentage_agree_within_their_rounding():
    # the bound test_train's one-clock check uses; 95.0 % with 0 s left at a 20-s budget sits right on it
    budget, worst = 20.0, 0.0
    for i in range(20001):
        elapsed = budget * i / 20000
        m = logfmt.STEP_RE.match(logfmt.format_step(1, 100 * elapsed / budget, 1.0, 1, None, 0.1, budget - elapsed))
        worst = max(worst, abs(int(m["remaining"]) - budget * (1 - float(m["pct"]) / 100)))
    assert 0.99 < worst <= logfmt.step_clock_slack(budget) + 1e-9


def test_summary_block_keys_in_order_and_unknowns():
    text = logfmt.format_summary(training_seconds=300.1, total_seconds=325.9, peak_vram_mb=None,
                                 mfu_percent=None, total_tokens_M=499.6, num_steps=953, num_params_M=50.3,
                                 depth=8, gpu="cpu", peak_tflops=None)
    lines = text.splitlines()
    assert lines[0] == "---"
    keys = [logfmt.SUMMARY_LINE_RE.match(x)["key"] for x in lines[1:]]
    assert tuple(keys) == logfmt.SUMMARY_KEYS
    values = {logfmt.SUMMARY_LINE_RE.match(x)["key"]: logfmt.SUMMARY_LINE_RE.match(x)["value"] for x in lines[1:]}
    assert "val_bpb" not in values       # the run's own score is not part of its summary (the evaluator's is)
    assert values["training_seconds"] == "300.1" and values["mfu_percent"] == "unknown"
    assert values["peak_vram_mb"] == "unknown" and values["peak_tflops"] == "unknown"


def test_a_small_runs_token_count_survives_the_summary():
    """36,864 tokens (9 CPU steps of 4,096) read 0.0K in `ar report` when the summary printed one decimal."""
    from autoresearch.experiment.metrics import parse_log
    text = logfmt.format_summary(training_seconds=3, total_seconds=4, peak_vram_mb=None, mfu_percent=None,
                                 total_tokens_M=36864 / 1e6, num_steps=9, num_params_M=1.0, depth=1, gpu="cpu",
                                 peak_tflops=None)
    assert parse_log(text).total_tokens_M == 0.036864
