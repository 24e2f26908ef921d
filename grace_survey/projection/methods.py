"""The methods ``grace-dgc project`` projects: measured, from a survey's summaries
(:func:`measured_methods`, each also with other communicators: :func:`with_communicators`),
or built from stated assumptions instead of a survey (:func:`assumed_methods`, Streaming
DiLoCo's bandwidth simulation)."""

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from grace_dgc.costmodel import GTOPK, modelled
from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import COMMUNICATORS, COMPRESSORS
from grace_survey.projection.model import Method
from grace_survey.running.results import latest_summaries


# -- from stated assumptions instead of a survey -------------------------------------------
def assumed_methods(
    parameters: float,
    step_s: float,
    workers: int,
    inner_steps: int = 100,
    fragments: int = 2,
    delay: int = 1,
    bits: int = 32,
    outer_bits: int = 4,
    buckets: int = 25,
) -> list[Method]:
    """The methods of Streaming DiLoCo's bandwidth simulation (its Table 4) as projectable
    methods built from assumptions, no survey: a model of ``parameters`` parameters whose
    inner step computes for ``step_s`` on each of ``workers`` workers, every exchange a ring
    allreduce of ``bits`` per parameter (``outer_bits`` for the quantized row), no codec time:

    - data-parallel: every step, overlapped with the backward pass over ``buckets`` buckets;
    - DiLoCo: every H = ``inner_steps`` steps, the whole model, blocking;
    - Streaming DiLoCo: P = ``fragments`` fragments, each every H steps, blocking (τ = 0);
    - … with overlap: each fragment's exchange overlapping τ = ``delay`` inner steps;
    - … and ``outer_bits``-bit outer gradients (FP4 in the paper)."""
    full = parameters * bits / 8

    def method(label: str, nbytes: float, schedule: dict[str, Any] | None, **extra: Any) -> Method:
        every = schedule["params"]["inner_steps"] if schedule else 1
        return {
            "label": label,
            "compute_s": step_s,
            "compress_s": 0.0,
            "decompress_s": 0.0,
            "bytes_per_step": nbytes / every,
            "dense_bytes_per_step": full / every,
            "exchanges_per_step": 1.0 / every,
            "groups_per_step": (buckets if schedule is None else schedule["params"].get("fragments", 1)) / every,
            "batch_size": None,
            "workers": workers,
            "rounds": 1,
            "compressor": "none",
            "communicator": "allreduce",
            "schedule": schedule,
            **extra,
        }

    def streaming(delay: int) -> dict[str, Any]:
        return {
            "name": "streaming_diloco",
            "params": {"inner_steps": inner_steps, "fragments": fragments, "delay": delay},
        }

    return [
        method("data-parallel", full, None, overlap="backward"),
        method(f"diloco H={inner_steps}", full, {"name": "diloco", "params": {"inner_steps": inner_steps}}),
        method(f"streaming diloco P={fragments}", full, streaming(0)),
        method(f"streaming diloco P={fragments}, overlap τ={delay}", full, streaming(delay)),
        method(
            f"streaming diloco P={fragments}, overlap τ={delay}, {outer_bits}-bit",
            parameters * outer_bits / 8,
            streaming(delay),
        ),
    ]


# -- from a survey directory ---------------------------------------------------------------
#: a method's own compute is flagged when it is further than this many robust standard
#: deviations (1.4826 · MAD) of the workload's runs from their median, and more than
#: ``COMPUTE_FLOOR`` of it: the runs of one model do the same forward and backward, so a
#: difference beyond the runs' noise is the machine or the method's own work on the
#: training thread (e.g. the DDP hook compressing inside the backward), not compression
COMPUTE_SIGMAS = 3.0
COMPUTE_FLOOR = 0.10


def measured_methods(records: Sequence[dict[str, Any]]) -> list[Method]:
    """One entry per method label: mean over seeds of its unshaped runs at the largest
    measured worker count (shaped runs are used only when there is no unshaped one).

    Every method of a workload is projected on the **same compute** ``compute_s``: the median
    forward + backward of all the workload's runs at that worker count (every method, every
    seed: :func:`shared_compute`). A method changes the exchange, not the model's compute,
    and one run's compute on a busy machine is noise (2.5–11.6 ms for the same model in one
    survey). The method's own measurement stays beside it (``own_compute_s``), with the
    workload's spread (``compute``) and ``compute_flagged`` when it lies outside that noise."""
    runs = latest_summaries(records)
    if not runs:
        raise GraceConfigError("no finished runs (summary lines) in this directory; run `grace-dgc survey` first")
    local = [r for r in runs if r.get("network", "local") == "local"] or runs
    by_label: dict[str, list[dict[str, Any]]] = {}
    for run in local:
        by_label.setdefault(run["label"], []).append(run)
    chosen = {}
    for label, rows in by_label.items():
        workers = max(r["workers"] for r in rows)
        chosen[label] = [r for r in rows if r["workers"] == workers]
    shared = shared_compute([r for rows in chosen.values() for r in rows])
    methods = []
    for label, rows in chosen.items():
        keys = (
            "compute_s",
            "compress_s",
            "decompress_s",
            "communicate_s",
            "bytes_per_step",
            "dense_bytes_per_step",
            "exchanges_per_step",
            "batch_size",
        )
        # a script-mode run that reports no samples has no batch size: its projection has no samples/s
        mean = {k: None if any(r.get(k) is None for r in rows) else sum(r[k] for r in rows) / len(rows) for k in keys}
        if all(r.get("groups_per_step") for r in rows):  # older surveys lack it
            mean["groups_per_step"] = sum(r["groups_per_step"] for r in rows) / len(rows)
        try:
            rounds = COMPRESSORS.get(rows[0]["compressor"]).rounds
        except GraceConfigError:
            rounds = 1
        reference = shared[_workload_key(rows[0])]
        own = mean["compute_s"]
        methods.append(
            dict(
                mean,
                label=label,
                workers=rows[0]["workers"],
                rounds=rounds,
                compressor=rows[0]["compressor"],
                schedule=rows[0].get("schedule"),
                communicator=modelled_name(rows[0]["communicator"], rows[0].get("params") or {}),
                compute_s=reference["median_s"],
                own_compute_s=own,
                compute=reference,
                compute_flagged=abs(own - reference["median_s"]) > reference["tolerance_s"],
            )
        )
    return methods


def _workload_key(run: Mapping[str, Any]) -> tuple[Any, ...]:
    """The runs that do the same forward and backward: one model, batch, worker count, device."""
    return (run.get("workload") or run.get("script"), run.get("batch_size"), run["workers"], run.get("device"))


def shared_compute(runs: Sequence[Mapping[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Per workload (:func:`_workload_key`), the compute every method of it is projected on:
    the median of its runs' ``compute_s``, their spread (min, max), their count, and the
    tolerance beyond which a method's own compute is flagged: max(``COMPUTE_SIGMAS`` ·
    1.4826 · MAD, ``COMPUTE_FLOOR`` · median)."""
    samples: dict[tuple[Any, ...], list[float]] = {}
    for run in runs:
        samples.setdefault(_workload_key(run), []).append(float(run["compute_s"]))
    out = {}
    for key, values in samples.items():
        median = statistics.median(values)
        sigma = 1.4826 * statistics.median(abs(v - median) for v in values)
        out[key] = {
            "median_s": median,
            "min_s": min(values),
            "max_s": max(values),
            "runs": len(values),
            "tolerance_s": max(COMPUTE_SIGMAS * sigma, COMPUTE_FLOOR * median),
        }
    return out


def modelled_name(communicator: str, params: Mapping[str, Any]) -> str:
    """The model's name of a measured run's communicator (gTop-k is a mode of sparse_allreduce)."""
    return GTOPK if communicator == "sparse_allreduce" and params.get("global_topk") else communicator


def with_communicators(methods: Sequence[Method], communicators: Sequence[str]) -> list[Method]:
    """``methods`` plus, for each method and each of ``communicators`` that can carry its
    compressor, the same measured method projected with that communicator."""
    out, known = list(methods), modelled()  # each registered class asked once, not per method and name
    for method in methods:
        if method["compressor"] == "none" and method["communicator"] == "allreduce":
            continue  # the dense baseline stays what it is
        for name in communicators:
            flat = name.split(":", 1)[-1]
            if flat not in known:
                raise GraceConfigError(f"no cost model for communicator {name!r}; accepted: {', '.join(known)}")
            try:
                fits = COMMUNICATORS.get(flat.split("+", 1)[0]).fits(COMPRESSORS.get(method["compressor"])())
            except GraceConfigError:
                fits = False
            if fits and name != method["communicator"]:
                out.append(
                    dict(
                        method,
                        label=f"{method['label']} @ {name}",
                        communicator=name,
                        measured_communicator=method["communicator"],
                    )
                )
    return out
