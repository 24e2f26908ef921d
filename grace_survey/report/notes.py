"""The report's "How to read this" notes (:func:`explanations`), each computed from the records
and written only where its case occurs: a method that keeps a smaller share of each gradient
yet sends more bytes (and why, as the method tells: :func:`bytes_notes`), fewer bytes but no
faster step on an unshaped loopback, fastest to the
target but not most accurate at the end, and "no significant difference" read as "equal"."""

import inspect
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import COMPRESSORS
from grace_survey.report.grouping import Group, baseline_of, combos, peers
from grace_survey.report.headline import metric_name, ranked, target_text
from grace_survey.report.significance import ALPHA, difference_interval, welch_test
from grace_survey.report.tables import milliseconds as ms
from grace_survey.units import human_bytes


class MeasuredBytes(NamedTuple):
    """What a survey measured of one method's bytes, as a method's ``bytes_notes`` reads them:
    bytes per worker and optimizer step, means over the method's seeds (None where the runs did
    not record them)."""

    ratio: float  # the share of each gradient the method was set to keep (its ``compress_ratio``)
    per_step: float | None  # over the whole run, any warm-up included
    last_epoch: float | None  # in the last epoch only
    dense: float | None  # what a dense fp32 exchange of the same gradients sends
    parameters: object  # the model's parameter count, as the runs recorded it ("?" where they did not)


#: what holds of any method's measured bytes: the answer of a method that has none of its own
WIRE_FORMAT_NOTE = "Measured bytes count the whole wire format: indices, headers and any tensor sent whole."

Notes = Callable[[Mapping[str, Any], MeasuredBytes, Callable[[float], str]], list[str]]


def bytes_notes(method: Any) -> Notes:
    """How the report asks a compressor why it sent more bytes than its ratio, where it keeps a
    smaller share of each gradient than another method of the survey yet sends more per step:
    the built-ins' answers are here (:data:`BUILT_IN_NOTES`); a plugin answers with a classmethod
    ``bytes_notes(params, measured, format_bytes)`` of its own class (``params``: the keyword
    arguments the runs built it with, a default left out is not there; ``measured``: their
    :class:`MeasuredBytes`; ``format_bytes`` prints a byte count as the report does), returning
    sentences (an empty list adds nothing). Plain data in, sentences out: nothing is built or
    run. Any other method gets :data:`WIRE_FORMAT_NOTE`."""
    own = getattr(method, "bytes_notes", None)
    if own is not None:
        return own
    return BUILT_IN_NOTES.get(getattr(method, "registered_name", ""), lambda *_: [WIRE_FORMAT_NOTE])


def _dgc_notes(params: Mapping[str, Any], measured: MeasuredBytes, format_bytes: Callable[[float], str]) -> list[str]:
    """Why a DGC run sent more than its ratio: its warm-up's denser exchanges, and the tensors its
    dense rule sends whole (``dense_1d``, ``min_compress_size``)."""
    notes = []
    warmup = params.get("warmup_epochs") or params.get("warmup_steps")
    if warmup and measured.last_epoch is not None:
        what = "epochs" if params.get("warmup_epochs") else "steps"
        notes.append(
            f"Part of it is warm-up: the run average counts {warmup} warm-up {what} of denser exchanges; "
            f"after them, in the last epoch, it still sent {format_bytes(measured.last_epoch)} per step."
        )
    whole = _dgc_whole_tensors(params, measured, format_bytes)
    return notes + ([whole] if whole else [])


def _dgc_whole_tensors(
    params: Mapping[str, Any], measured: MeasuredBytes, format_bytes: Callable[[float], str]
) -> str | None:
    """What DGC's dense rule sends whole, and how much of the bytes that is; None: nothing."""
    defaults = inspect.signature(COMPRESSORS.get("dgc")).parameters

    def setting(name: str) -> Any:  # as the run had it: its parameter, else the default
        return params[name] if name in params else defaults[name].default

    rules = []
    if setting("dense_1d"):
        rules.append("tensors of dim ≤ 1 (biases, norm weights)")
    minimum = setting("min_compress_size")
    if minimum:
        rules.append(f"tensors of fewer than {minimum} elements")
    if not rules:
        return None
    text = f"DGC sends {' and '.join(rules)} whole, in {'fp16' if setting('fp16_values') else 'fp32'}"
    ratio, dense = measured.ratio, measured.dense
    sent = measured.last_epoch if measured.last_epoch is not None else measured.per_step
    if not (dense and sent and sent > 4 * ratio * dense):  # values + indices of the kept share are at most 2×
        return text + "."
    share = ratio * dense
    return text + (
        f": {ratio:g} of the {format_bytes(dense)} dense gradient is {format_bytes(share)}, so most of the "
        f"{format_bytes(sent)} it sends per step ({sent / share:.3g}×) is those whole tensors, which on a small "
        f"model ({measured.parameters} parameters) outweigh what the ratio saves."
    )


#: the built-in compressors' answers to :func:`bytes_notes`, by registered name
BUILT_IN_NOTES: dict[str, Notes] = {"dgc": _dgc_notes}


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
    (:func:`bytes_notes`), each sentence after a space; a compressor not registered here (a
    plugin not installed), or a composite, says what any method would."""
    run = group.runs[0]
    try:
        method = COMPRESSORS.get(run.get("compressor") or "")
    except GraceConfigError:
        method = None
    ask = bytes_notes(method)
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
