"""The report's "How to read this" notes (:func:`explanations`), each computed from the records
and written only where its case occurs: a method that keeps a smaller share of each gradient
yet sends more bytes (and why, as the method itself tells: its compressor's
``bytes_notes``), fewer bytes but no faster step on an unshaped loopback, fastest to the
target but not most accurate at the end, and "no significant difference" read as "equal"."""

import statistics
from collections.abc import Sequence

import numpy as np

from grace_dgc.errors import GraceConfigError
from grace_dgc.interfaces import Compressor, MeasuredBytes
from grace_dgc.registry import COMPRESSORS
from grace_survey.report.grouping import Group, baseline_of, combos, peers
from grace_survey.report.headline import metric_name, ranked, target_text
from grace_survey.report.significance import ALPHA, difference_interval, welch_test
from grace_survey.report.tables import milliseconds as ms
from grace_survey.units import human_bytes


def explanations(groups: Sequence[Group]) -> list[str]:
    """The "How to read this" bullets: each only where its case is in the data."""
    return (
        _explain_bytes(groups)
        + _explain_loopback(groups)
        + _explain_final_vs_time(groups)
        + _explain_not_significant(groups)
    )


def _nominal_ratio(group: Group) -> float | None:
    value = (group.runs[0].get("params") or {}).get("compress_ratio")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _last_epoch_bytes(group: Group) -> float | None:
    last = [e[-1]["bytes_per_step"] for e in group.epochs if e and e[-1].get("bytes_per_step") is not None]
    return statistics.mean(last) if last else None


def _bytes(group: Group) -> float:
    value = group.mean("bytes_per_step")
    return float("nan") if value is None else value


def _explain_bytes(groups: Sequence[Group]) -> list[str]:
    """(a) a method that keeps a smaller share of the gradient but sends more bytes."""
    out = []
    for combo in combos(groups):
        sparse = [
            g for g in peers(groups, combo) if _nominal_ratio(g) is not None and g.mean("bytes_per_step") is not None
        ]
        for a in sparse:
            for b in sparse:
                ra, rb = _nominal_ratio(a), _nominal_ratio(b)
                ba, bb = _bytes(a), _bytes(b)
                if ra is None or rb is None or not (ra < rb and ba > bb):
                    continue
                text = (
                    f"**{a.label} sends more bytes than {b.label}**, though it keeps a smaller share of each "
                    f"gradient ({ra:g} against {rb:g}): measured {human_bytes(ba)} per step per worker "
                    f"(compression ratio {a.mean('compression_ratio'):.4g}) against {human_bytes(bb)} "
                    f"({b.mean('compression_ratio'):.4g})."
                )
                out.append(text + _method_notes(a, ra))
    return out


def _method_notes(group: Group, ratio: float) -> str:
    """What the method of ``group`` says about why it sent more bytes than its ratio
    (:meth:`grace_dgc.interfaces.Compressor.bytes_notes`), each sentence after a space; a
    compressor not registered here (a plugin not installed), or a composite, says what any
    method would."""
    run = group.runs[0]
    try:
        method = COMPRESSORS.get(run.get("compressor") or "")
    except GraceConfigError:
        method = Compressor
    ask = getattr(method, "bytes_notes", Compressor.bytes_notes)
    measured = MeasuredBytes(
        ratio=ratio,
        per_step=group.mean("bytes_per_step"),
        last_epoch=_last_epoch_bytes(group),
        dense=group.mean("dense_bytes_per_step"),
        parameters=run.get("parameters", "?"),
    )
    return "".join(f" {sentence}" for sentence in ask(run.get("params") or {}, measured, human_bytes))


def _unshaped(group: Group) -> bool:
    return all(not r.get("bandwidth_bps") and not r.get("latency_ms") for r in group.runs)


def _explain_loopback(groups: Sequence[Group]) -> list[str]:
    """(b) fewer bytes but no faster step, on an unshaped loopback."""
    out = []
    for combo in combos(groups):
        same = peers(groups, combo)
        base = baseline_of(same[0], groups)
        if not _unshaped(base) or base.mean("step_s") is None:
            continue
        slower = [
            g
            for g in same
            if g is not base
            and _unshaped(g)
            and _bytes(g) < _bytes(base)
            and g.mean("step_s") is not None
            and g.mean("step_s") >= base.mean("step_s")  # type: ignore[operator]
        ]
        if not slower:
            continue
        cases = "; ".join(
            f"{g.label} sends {_bytes(base) / max(_bytes(g), 1e-9):.3g}× fewer bytes ({human_bytes(_bytes(g))}) "
            f"in {ms(g.mean('communicate_s'))} ms of communication, spends {ms(g.mean('compress_s'))} ms "
            f"compressing and {ms(g.mean('decompress_s'))} ms decompressing, and its step takes "
            f"{ms(g.mean('step_s'))} ms"
            for g in slower
        )
        where = f" ({combo[0]} workers, {combo[1]})" if len(combos(groups)) > 1 else ""
        out.append(
            f"**Fewer bytes did not make a step faster here{where}.** These runs used an unshaped local loopback, "
            f"where moving bytes costs almost nothing: {base.label} sends {human_bytes(_bytes(base))} per step "
            f"in {ms(base.mean('communicate_s'))} ms of communication and its step takes "
            f"{ms(base.mean('step_s'))} ms. Against that, {cases}. Bytes turn into time only where the network "
            "is the bottleneck: rerun with `--bandwidth`, or model larger clusters with `grace-dgc project`."
        )
    return out


def _explain_final_vs_time(groups: Sequence[Group]) -> list[str]:
    """(c) the fastest to the target is not the most accurate at the end, or a seed reached the
    target and ended below it."""
    out: list[str] = []
    if groups[0].runs[0].get("target_accuracy") is None:  # no target: nothing reached it first
        return out
    rows = ranked(groups)
    for combo in combos(groups):
        same = [(rank, g, reach) for rank, g, reach in rows if (g.workers, g.network) == combo]
        scored = [(rank, g, reach) for rank, g, reach in same if g.mean("final_test_accuracy") is not None]
        if not scored:
            continue
        first = scored[0]
        best = max(scored, key=lambda row: row[1].mean("final_test_accuracy") or 0.0)
        metric = metric_name(first[1].runs[0])
        if best[1] is not first[1] and first[2].tier < 2:
            out.append(
                f"**Fastest to the target is not most accurate at the end.** {first[1].label} ranks first "
                f"(reaches {target_text(first[2].target)} {metric} first) yet ends at "
                f"{first[1].mean('final_test_accuracy'):.4f}; {best[1].label} ranks {best[0]} and ends at "
                f"{best[1].mean('final_test_accuracy'):.4f}. The headline answers how fast a method gets to a "
                f"fixed {metric}; the final {metric} (the throughput table, the seed statistics) answers where "
                f"it stands after {first[1].runs[0].get('epochs', '?')} epochs. They are different questions."
            )
        dropped = [
            (
                g,
                sum(
                    1
                    for r in g.runs
                    if r.get("time_to_target_s") is not None and r["final_test_accuracy"] < reach.target
                ),
            )
            for _, g, reach in same
        ]
        dropped = [(g, n) for g, n in dropped if n]
        if dropped:
            listing = ", ".join(f"{g.label} ({n} of {len(g.runs)} seeds)" for g, n in dropped)
            out.append(
                f"**Reached the target, then ended below it:** {listing}. {metric.capitalize()} moves from epoch to "
                "epoch; the headline counts the first epoch at or above the target, the final figures the last."
            )
    return out


def _explain_not_significant(groups: Sequence[Group], key: str = "final_test_accuracy") -> list[str]:
    """(d) "no significant difference" is not "equal"; one seed supports no claim."""
    cases, untestable = [], []
    for g in groups:
        base = baseline_of(g, groups)
        if base is g:
            continue
        values, reference = g.values(key), base.values(key)
        test = welch_test(values, reference) if values and reference else None
        if test is None:
            if values and reference and (len(values) < 2 or len(reference) < 2):
                untestable.append(g.label)
            continue
        interval = difference_interval(values, reference)
        if test[1] >= ALPHA and interval is not None:
            delta = float(np.mean(values) - np.mean(reference))
            cases.append(f"{g.label} − {base.label}: {delta:+.4f}, 95% CI [{interval[0]:+.4f}, {interval[1]:+.4f}]")
    out = []
    if cases:
        seeds = sorted({len(g.runs) for g in groups})
        n = "/".join(map(str, seeds))
        out.append(
            f'**"No significant difference" means not shown different, not equal.** With {n} seeds a test '
            f"only detects large differences; the final {metric_name(groups[0].runs[0])} differences the seeds "
            f"could not tell apart from zero still allow these ranges: {'; '.join(cases)}. A difference inside "
            "the interval is as consistent with the data as no difference."
        )
    if untestable:
        out.append(
            f"**One seed supports no claim:** {', '.join(untestable)} (or its baseline) ran one seed, so no test "
            "could be made; add seeds to compare them."
        )
    return out
