"""The report's faults section: each method that lost a replica group under torchft
(:mod:`grace_survey.running.faults`), beside the same method, workers and seeds under torchft
with no fault. Both are launched alike (a lighthouse and a process per group), so what differs
is the fault's alone."""

from collections.abc import Sequence

from grace_survey.report.grouping import Group
from grace_survey.report.headline import metric_name

FAULTS_TEXT = (
    "Each row is a method that lost a replica group (killed as the job reached a step, started again some steps "
    "later, healed from a peer), set beside the same method under torchft with no fault: a lighthouse and a "
    "process per group in both. *time lost* is the training time with the fault minus without it (the steps "
    "the survivors' exchanges waited for the lost group, its restart and its heal); *discarded* is the steps "
    "group 0 threw away (a step whose exchange met the loss). The figures are group 0's, which never dies and "
    "evaluates its own model on the whole test split after each epoch (a schedule's mid-round model, as is)."
)


def _under_torchft(group: Group) -> str | None:
    """The fault tag of ``group``'s runs (``torchft`` for none), or None for a run outside torchft."""
    tags = {r.get("fault") for r in group.runs}
    return tags.pop() if len(tags) == 1 else None


def fault_rows(groups: Sequence[Group]) -> list[tuple[Group, Group]]:
    """(faulted group, its torchft baseline) pairs: same label and workers."""
    baselines = {(g.label, g.workers): g for g in groups if _under_torchft(g) == "torchft"}
    return [
        (g, baselines[(g.label, g.workers)])
        for g in groups
        if _under_torchft(g) not in (None, "torchft") and (g.label, g.workers) in baselines
    ]


def _mean(group: Group, key: str) -> float | None:
    value = group.mean(key)
    return None if value is None else float(value)


def fault_table(rows: Sequence[tuple[Group, Group]]) -> str:
    """One line per (method, workers, fault): the final metric and the training time with and
    without the fault, their differences, and the steps group 0 discarded (means over seeds)."""
    metric = metric_name(rows[0][0].runs[0])
    head = (
        f"| method | workers | fault | final {metric}: no fault → fault (Δ) | train time s: no fault → fault "
        "| time lost s | discarded steps | back by the end | seeds |"
    )
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for faulted, baseline in rows:
        final = [_mean(g, "final_test_accuracy") for g in (baseline, faulted)]
        times = [_mean(g, "train_time_s") for g in (baseline, faulted)]
        if None in final:
            shown_final = "n/a"
        else:
            shown_final = f"{final[0]:.4f} → {final[1]:.4f} ({final[1] - final[0]:+.4f})"  # type: ignore[operator]
        lost = "n/a" if None in times else f"{times[1] - times[0]:+.1f}"  # type: ignore[operator]
        shown_times = "n/a" if None in times else f"{times[0]:.1f} → {times[1]:.1f}"
        discarded = _mean(faulted, "discarded_steps")
        back = sum(r.get("groups_at_end") == faulted.workers for r in faulted.runs)
        lines.append(
            f"| {faulted.label} | {faulted.workers} | {faulted.runs[0]['fault']} | {shown_final} | {shown_times} "
            f"| {lost} | {'n/a' if discarded is None else f'{discarded:g}'} | {back} of {len(faulted.runs)} "
            f"| {len(faulted.runs)} |"
        )
    return "\n".join(lines)
