"""The report's headline (methods ranked by time to the target), its "How to read this"
notes and the language-model perplexity column, on synthetic results.jsonl files: the
ranking rule, the "never reached" / "k of n seeds" wording, the CIs and speed-ups against an
independent computation (scipy.stats.t), and each note present exactly when its case is."""

import json
import math
import os
import statistics

import pytest
from scipy import stats

from grace_survey import report
from grace_survey.units import human_bytes

TARGET = 0.6
EPOCHS = 10


def run_records(label, seed, *, time=None, epochs=None, final=None, best=None, compressor=None, **extra):
    """One run's epoch records and summary; ``time`` None: the run never reached the target."""
    final = 0.62 + 0.002 * seed if final is None else final
    compressor = compressor or ("none" if label == "dense" else "topk")
    summary = {
        "type": "summary",
        "run_id": f"{label} w2 s{seed}",
        "attempt": f"{label}-{seed}",
        "label": label,
        "compressor": compressor,
        "memory": "none",
        "communicator": "allreduce" if compressor == "none" else "allgather",
        "params": {},
        "tags": {},
        "workers": 2,
        "seed": seed,
        "network": "local",
        "bandwidth_bps": None,
        "latency_ms": None,
        "workload": "mnist1d-mlp",
        "workload_description": "synthetic",
        "parameters": 15210,
        "batch_size": 32,
        "global_batch": 64,
        "lr": 0.05,
        "lr_tuning": None,
        "momentum": 0.9,
        "epochs": EPOCHS,
        "steps_per_epoch": 62,
        "steps": 620,
        "final_test_accuracy": final,
        "final_test_loss": 1.0,
        "final_train_accuracy": final + 0.05,
        "final_train_loss": 0.9,
        "best_test_accuracy": best if best is not None else max(final, TARGET if time is not None else final),
        "target_accuracy": TARGET,
        "epochs_to_target": (epochs if epochs is not None else 5) if time is not None else None,
        "time_to_target_s": time,
        "train_time_s": 20.0,
        "samples_per_s": 2000.0,
        "bytes_per_step": 60840.0,
        "dense_bytes_per_step": 60840.0,
        "compression_ratio": 1.0,
        "compute_s": 0.001,
        "compress_s": 0.0,
        "communicate_s": 0.001,
        "decompress_s": 0.0,
        "wait_s": 0.001,
        "step_s": 0.002,
        "peak_rss_mb": 300.0,
        "peak_gpu_mb": 0.0,
        "device": "cpu",
        "backend": "gloo",
        "torch": "x",
        "host": "h",
    }
    last_bytes = extra.pop("last_epoch_bytes", None)
    summary.update(extra)
    epoch_records = [
        {
            "type": "epoch",
            "run_id": summary["run_id"],
            "attempt": summary["attempt"],
            "label": label,
            "workers": 2,
            "seed": seed,
            "network": "local",
            "epoch": e,
            "test_accuracy": final * e / EPOCHS,
            "test_loss": 2.0 - e / EPOCHS,
            "bytes_per_step": last_bytes if e == EPOCHS and last_bytes else summary["bytes_per_step"],
        }
        for e in range(1, EPOCHS + 1)
    ]
    return epoch_records + [summary]


def write(directory, records):
    with open(os.path.join(directory, "results.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    with open(report.write_report(str(directory))) as f:
        return f.read()


def table_rows(text, header_start):
    """The rows (as lists of cells) of the table whose header line starts with ``header_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def section(text, title):
    """The text of ``## title`` up to the next section."""
    lines = text.splitlines()
    start = lines.index(f"## {title}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start + 1 : end])


def t_interval(values):
    """The 95% interval of the geometric mean: Student t on the logs, mapped back (a time or
    an epoch count is positive; a plain t interval of 2 seeds' times went negative)."""
    n, logs = len(values), [math.log(v) for v in values]
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(statistics.mean(logs) - half), math.exp(statistics.mean(logs) + half)


# -- ranking -------------------------------------------------------------------------------
DENSE = [10.0, 11.0, 13.0]
FAST = [5.0, 6.5, 7.0]
PARTIAL_TIMES = [3.0, 4.0]  # faster than everyone, but only 2 of 3 seeds


def ranking_records():
    records = []
    for seed, t in enumerate(DENSE):  # the baseline, listed first
        records += run_records("dense", seed, time=t, epochs=seed + 6, final=0.63 + 0.001 * seed)
    for seed, t in enumerate([None, *PARTIAL_TIMES]):
        records += run_records("partial", seed, time=t, epochs=4, final=0.61 if t else 0.55, best=0.58)
    for seed, best in enumerate([0.583, 0.57, 0.5]):
        records += run_records("never a", seed, time=None, final=best - 0.01, best=best)
    for seed, t in enumerate([None, None, 2.0]):
        records += run_records("one seed got there", seed, time=t, epochs=3, final=0.6 if t else 0.5, best=0.59)
    for seed, t in enumerate(FAST):
        records += run_records("fast", seed, time=t, epochs=seed + 3)
    for seed, best in enumerate([0.59, 0.5996, 0.58]):
        records += run_records("never b", seed, time=None, final=0.57 - 0.01 * seed, best=best)
    return records


def test_headline_is_the_first_table_and_follows_the_ranking_rule(tmp_path):
    text = write(tmp_path, ranking_records())
    first_table = next(line for line in text.splitlines() if line.startswith("|"))
    assert first_table.startswith(
        "| Rank | Method | Workers | Network | Reached the target | Time to 0.60 test accuracy"
    )
    # the headline section comes before the throughput table, which comes before the statistics
    titles = [line for line in text.splitlines() if line.startswith("## ")]
    assert titles[:2] == ["## Time to test accuracy 0.60 (the headline)", "## Throughput, bytes and final accuracy"]
    assert titles.index("## Throughput, bytes and final accuracy") < titles.index(
        "## Do the seeds support the differences?"
    )
    assert "**Ranking rule**" in section(text, "Time to test accuracy 0.60 (the headline)")

    rows = table_rows(text, "| Rank | Method |")
    # every seed reached it, by mean time; then some seeds, by share; then never, by best accuracy
    assert [(r[0], r[1]) for r in rows] == [
        ("1", "fast"),
        ("2", "dense"),
        ("3", "partial"),
        ("4", "one seed got there"),
        ("5", "never b"),
        ("6", "never a"),
    ]
    status = {r[1]: r[4] for r in rows}
    assert status == {
        "fast": "all 3 seeds",
        "dense": "all 3 seeds",
        "partial": "2 of 3 seeds reached it",
        "one seed got there": "1 of 3 seeds reached it",
        # 0.5996 would print as 0.600 at 3 decimals: more digits keep it visibly below the target
        "never b": "never reached (best 0.5996 < target 0.60)",
        "never a": "never reached (best 0.583 < target 0.60)",
    }
    assert text.count("never reached (") == 2
    assert text.count("2 of 3 seeds reached it") == 1 and text.count("1 of 3 seeds reached it") == 1
    by_label = {r[1]: r for r in rows}
    for label in ("never a", "never b"):
        assert by_label[label][5:11] == ["—"] * 6
    # a partial method's mean is over the seeds that reached it, and says so
    assert by_label["partial"][5] == "3.50 s (2 seeds)" and by_label["partial"][9] == "—"
    assert by_label["one seed got there"][6] == "too few seeds (1; an interval needs 3)"


def test_headline_intervals_speedups_and_welch_p_against_scipy(tmp_path):
    text = write(tmp_path, ranking_records())
    by_label = {r[1]: r for r in table_rows(text, "| Rank | Method |")}
    for label, times, epochs in (("dense", DENSE, [6, 7, 8]), ("fast", FAST, [3, 4, 5])):
        row = by_label[label]
        lo, hi = t_interval(times)
        assert row[5] == f"{statistics.mean(times):.2f} s"
        assert row[6] == f"[{lo:.2f}, {hi:.2f}] s"
        lo, hi = t_interval(epochs)
        assert row[7] == f"{statistics.mean(epochs):.2f}" and row[8] == f"[{lo:.2f}, {hi:.2f}]"
    assert by_label["partial"][6] == "too few seeds (2; an interval needs 3)"  # 2 of 3 seeds reached it
    assert by_label["dense"][9] == "1.00× (baseline)"
    assert by_label["fast"][9] == f"{statistics.mean(DENSE) / statistics.mean(FAST):.2f}×"
    p = stats.ttest_ind(FAST, DENSE, equal_var=False).pvalue
    assert by_label["fast"][10] == f"{p:.3g}"
    assert by_label["fast"][11] == "0.6220"


def test_no_speedup_when_the_baseline_itself_missed_the_target_in_a_seed(tmp_path):
    records = []
    for seed, t in enumerate([10.0, None, 12.0]):
        records += run_records("dense", seed, time=t, final=0.61 if t else 0.59, best=0.598 if t is None else None)
    for seed, t in enumerate(FAST):
        records += run_records("fast", seed, time=t)
    rows = {r[1]: r for r in table_rows(write(tmp_path, records), "| Rank | Method |")}
    assert rows["dense"][4] == "2 of 3 seeds reached it" and rows["dense"][9] == "(baseline)"
    assert rows["fast"][0] == "1" and rows["fast"][9] == "—" and rows["fast"][10] == "—"


def test_one_seed_has_no_interval(tmp_path):
    records = run_records("dense", 0, time=10.0) + run_records("fast", 0, time=5.0)
    rows = {r[1]: r for r in table_rows(write(tmp_path, records), "| Rank | Method |")}
    assert rows["fast"][4] == "yes (1 seed)" and rows["fast"][6] == "too few seeds (1; an interval needs 3)"
    assert rows["fast"][9] == "2.00×" and rows["fast"][10] == "—"


# -- how to read this ----------------------------------------------------------------------
def sparse(label, compressor, ratio, bytes_per_step, seed, **extra):
    return run_records(
        label,
        seed,
        time=None,
        final=0.55,
        compressor=compressor,
        params={"compress_ratio": ratio, "warmup_epochs": 2} if compressor == "dgc" else {"compress_ratio": ratio},
        bytes_per_step=bytes_per_step,
        compression_ratio=bytes_per_step / 60840.0,
        **extra,
    )


def test_dgc_bytes_note_only_when_dgc_sends_more_than_topk(tmp_path):
    records = []
    for seed in range(3):
        records += run_records("dense", seed, time=10.0 + seed)
        records += sparse("topk 1%", "topk", 0.01, 1320.0, seed)
        records += sparse("dgc 0.1%", "dgc", 0.001, 5380.0, seed, last_epoch_bytes=4900.0)
    text = write(tmp_path, records)
    notes = section(text, "How to read this")
    assert "**dgc 0.1% sends more bytes than topk 1%**" in notes
    assert f"measured {human_bytes(5380.0)} per step per worker" in notes and f"against {human_bytes(1320.0)}" in notes
    assert "tensors of dim ≤ 1 (biases, norm weights)" in notes and "fewer than 1024 elements" in notes
    assert f"in the last epoch, it still sent {human_bytes(4900.0)}" in notes
    assert f"({4900.0 / (0.001 * 60840.0):.3g}×)" in notes

    # the same survey with a DGC that does send fewer bytes: no note
    (tmp_path / "b").mkdir()
    records = []
    for seed in range(3):
        records += run_records("dense", seed, time=10.0 + seed)
        records += sparse("topk 1%", "topk", 0.01, 1320.0, seed)
        records += sparse("dgc 0.1%", "dgc", 0.001, 600.0, seed)
    text = write(tmp_path / "b", records)
    assert "sends more bytes than" not in text


def test_no_notes_section_when_no_case_is_present(tmp_path):
    records = []
    for seed in range(3):
        # fewer bytes and a faster step, first to the target and the best at the end, clearly better
        records += run_records("dense", seed, time=10.0 + seed, final=0.61 + 0.001 * seed, metric="accuracy")
        records += run_records(
            "fast",
            seed,
            time=5.0 + seed,
            final=0.70 + 0.001 * seed,
            bytes_per_step=1000.0,
            step_s=0.001,
            metric="accuracy",
        )
    text = write(tmp_path, records)
    assert "| Time to 0.60 test accuracy (mean) |" in text  # the workload's metric, on the test split
    assert "## How to read this" not in text
    assert "Perplexity" not in text  # not a language model: no column, no definition


def test_loopback_final_accuracy_and_significance_notes(tmp_path):
    records = []
    dense_final = [0.64, 0.645, 0.65]
    slow_final = [0.62, 0.66, 0.69]
    for seed in range(3):
        records += run_records("dense", seed, time=10.0 + seed, final=dense_final[seed])
        # fewer bytes but a slower step; gets there first yet ends lower; no significant difference
        records += run_records(
            "topk 1%",
            seed,
            time=5.0 + seed,
            final=0.60 + 0.001 * seed,
            bytes_per_step=1320.0,
            step_s=0.005,
            compress_s=0.0006,
        )
        records += run_records("slow", seed, time=20.0 + seed, final=slow_final[seed])
    text = write(tmp_path, records)
    rows = {r[1]: r for r in table_rows(text, "| Rank | Method |")}
    assert rows["slow"][9] == f"{11.0 / 21.0:.2f}× (slower)" and rows["topk 1%"][9] == f"{11.0 / 6.0:.2f}×"
    notes = section(text, "How to read this")
    assert "**Fewer bytes did not make a step faster here.**" in notes
    assert "topk 1% sends 46.1× fewer bytes" in notes and "its step takes 5.00 ms" in notes
    assert "**Fastest to the target is not most accurate at the end.** topk 1% ranks first" in notes
    assert "slow ranks 3 and ends at 0.6567" in notes
    # slow − dense: Welch p ≥ 0.05, and the CI of the difference (Welch–Satterthwaite) is given
    assert stats.ttest_ind(slow_final, dense_final, equal_var=False).pvalue >= 0.05
    va, vb = statistics.variance(slow_final) / 3, statistics.variance(dense_final) / 3
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)
    half = stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    delta = statistics.mean(slow_final) - statistics.mean(dense_final)
    assert '"No significant difference" means not shown different, not equal.' in notes
    assert f"slow − dense: {delta:+.4f}, 95% CI [{delta - half:+.4f}, {delta + half:+.4f}]" in notes
    assert "topk 1% − dense" not in notes  # that one is significant
    assert "sends more bytes than" not in notes


def test_reached_then_ended_below_note(tmp_path):
    records = []
    for seed in range(2):
        records += run_records("dense", seed, time=10.0, final=0.59 if seed else 0.62)
    notes = section(write(tmp_path, records), "How to read this")
    assert "**Reached the target, then ended below it:** dense (1 of 2 seeds)." in notes


# -- language models -----------------------------------------------------------------------
@pytest.mark.parametrize("marker", [{"loss": "lm"}, {"metric": "next-token accuracy"}])
def test_perplexity_is_exp_of_the_final_test_loss(tmp_path, marker):
    losses = {"dense": [4.6, 4.8], "topk 1%": [5.0, 5.1]}
    records = []
    for label, values in losses.items():
        for seed, loss in enumerate(values):
            records += run_records(
                label, seed, time=30.0 + seed, final=0.3, final_test_loss=loss, workload="ptb-lstm", **marker
            )
    text = write(tmp_path, records)
    assert (
        "| Rank | Method | Workers | Network | Reached the target | Time to 0.60 test next-token accuracy (mean)"
        in text
    )
    header = next(line for line in text.splitlines() if line.startswith("| Method | Workers | Network | Seeds |"))
    column = [c.strip() for c in header.strip("|").split("|")].index("Perplexity")
    assert "- **Perplexity** (language models): exp(final test loss)" in text
    rows = {r[0]: r for r in table_rows(text, "| Method | Workers | Network | Seeds |")}
    for label, values in losses.items():
        perplexities = [math.exp(v) for v in values]
        expected = f"{statistics.mean(perplexities):.2f} ± {statistics.stdev(perplexities):.2f}"
        assert rows[label][column] == expected
    (tmp_path / "one").mkdir()
    text = write(tmp_path / "one", run_records("dense", 0, time=3.0, final_test_loss=4.6, **marker))
    rows = table_rows(text, "| Method | Workers | Network | Seeds |")
    assert rows[0][column] == f"{math.exp(4.6):.2f}"
    assert rows[0][column - 1] == "(baseline)"  # the loss gap to dense, in nats, beside it
