"""``grace-dgc project``: step time and speedup over dense allreduce on N nodes, projected
from a survey's measured figures with the α-β cost model.

Notation: N nodes, α latency per message (seconds; ``--latency`` in ms), β = 8 / bandwidth
seconds per byte, n bytes one rank contributes. Collective costs (Thakur et al. 2005;
Chan et al. 2007):

    ring allreduce         T_ar(N, n) = 2(N−1)·α + 2(N−1)/N · n·β
    ring allgather         T_ag(N, n) = (N−1)·α + (N−1) · n·β
    broadcast, each rank   T_bc(N, n) = N · (⌈log2 N⌉·α + n·β)
      in turn (pipelined tree per broadcast: log2 N latency hops, n bytes of bandwidth)

Per optimizer step, with the survey's measured per-step figures of a method — compute c
(forward + backward), compress s, decompress d (measured at W workers), payload bytes b
per worker (size headers included), e gradient exchanges per step (the fusion groups
exchanged, each one set of collectives, as measured; the tensors, for surveys older than
that count) and r rounds per exchange (PowerSGD: 2):

    communication  allreduce  m·2(N−1)·α + 2(N−1)/N · b·β,      m = e·r
                   allgather  2m·(N−1)·α + (N−1) · b·β          (size headers, then data)
                   broadcast  m·(N−1)·α + m·N·⌈log2 N⌉·α + N · b·β
    decompress     d for allreduce (one summed payload); d·N/W otherwise (one per rank)
    step time      T(N) = c + s + decompress + communication    (no overlap assumed)

The communicators that aggregate in the collective (b = one rank's payload per step, D its
dense fp32 bytes; four collectives per exchange: sizes, then data, both ways):

    sparse_allreduce  4m·(N−1)·α + (N−1)/N · (b + min(N·b, D))·β   (pairs to the owners;
                      the summed regions back, sparse, or dense when that is smaller; the
                      union of N payloads taken as disjoint: an upper bound)
    sparse_allreduce+global_topk   (gTop-k: 4 histogram allreduces find the threshold, then
                      only the K kept pairs, about one payload, come back)
                      (4 + 4·2)·m·(N−1)·α + 2(N−1)/N · b·β
    reduce_scatter    4m·(N−1)·α + 2(N−1)/N · b·β                 (chunks to the owners,
                      the requantized chunks back)
    hierarchical:C    the outer communicator C among N nodes, plus a dense ring allreduce and
                      a broadcast inside each node of ``--group-size`` ranks at
                      ``--node-bandwidth`` (default 100 Gbit/s, latency ignored)
    decompress        d (one aggregate, not one payload per rank)

``--communicators sparse_allreduce,reduce_scatter`` projects each method also with those
communicators (where they can carry its compressor), labelled ``method @ communicator``.

Dense baseline: the survey's ``none``/allreduce run projected by the same formula (its
measured c, s, d and bytes B); without one, T_dense(N) = c + e·2(N−1)·α + 2(N−1)/N · B·β
with the method's own compute and B its measured fp32 bytes per step (its e). Speedup =
T_dense(N) / T(N).
Weak scaling: each node keeps the measured per-worker batch, so c does not change with N.
Compute utilization = c / T(N): the share of a step spent computing. For each method, node
count and latency the projection also solves for the bandwidth that keeps it at 90 % and 95 %
(T is affine in β, so c/T = u gives β = (c/u − T(β=0)) / (dT/dβ)); "never" when latency,
compression or decompression alone take more than (1/u − 1)·c. ``--rtt`` takes round-trip
times (α = RTT/2) and ``--low-bandwidth`` sweeps 0.1–10 Gbit/s at 1, 50 and 500 ms round
trips, the cross-datacenter and internet settings of DiLoCo-style training.
The model ignores compute/communication overlap (real dense allreduce overlaps part of
backward, so compression's advantage is an upper bound), congestion and stragglers.
"""

import argparse
import csv
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from grace_dgc.communicators.sparse_allreduce import RADIX_ROUNDS

# the per-communicator steps and bytes are each communicator's own, read through the core's model
from grace_dgc.costmodel import GTOPK, cost, modelled
from grace_dgc.errors import GraceConfigError
from grace_survey.units import format_rate, human_bytes, parse_latency, parse_rate

Method = dict[str, Any]  # one measured method: the summary's per-step figures (see project_step)
Row = dict[str, Any]  # one projected row (see project)
Node = tuple[int, float]  # (ranks per node, bandwidth or β inside a node)


# -- the cost model ------------------------------------------------------------------------
def ring_allreduce(nodes: int, nbytes: float, alpha: float, beta: float, messages: float = 1) -> float:
    if nodes <= 1:
        return 0.0
    return messages * 2 * (nodes - 1) * alpha + 2 * (nodes - 1) / nodes * nbytes * beta


def allgather(nodes: int, nbytes: float, alpha: float, beta: float, messages: float = 1) -> float:
    if nodes <= 1:
        return 0.0
    return messages * (nodes - 1) * alpha + (nodes - 1) * nbytes * beta


def broadcast_each(nodes: int, nbytes: float, alpha: float, beta: float, messages: float = 1) -> float:
    if nodes <= 1:
        return 0.0
    return messages * nodes * math.ceil(math.log2(nodes)) * alpha + nodes * nbytes * beta


def counted_bytes(communicator: str, nodes: int, nbytes: float, dense_bytes: float) -> tuple[float, float]:
    """``(bytes_sent, bytes_received)`` the engine counts on one rank for one exchange of a
    payload of ``nbytes`` (size headers aside): what a test compares with ``grace.stats()``."""
    share = (nodes - 1) / nodes
    if communicator == "allreduce":
        return nbytes, nbytes
    if communicator == "allgather":
        return nbytes, (nodes - 1) * nbytes
    if communicator == "sparse_allreduce":  # own pairs out; an owner's summed region, gathered
        region = min(nodes * nbytes, dense_bytes) / nodes
        return share * nbytes + region, share * nbytes + (nodes - 1) * region
    if communicator in ("reduce_scatter", GTOPK):  # own share out; the owner's share of the result, gathered
        histograms = RADIX_ROUNDS * 256 * 4 if communicator == GTOPK else 0  # int32 counts, one tensor
        return (
            share * nbytes + nbytes / nodes + histograms,
            share * nbytes + (nodes - 1) * nbytes / nodes + histograms,
        )
    raise GraceConfigError(f"no byte count for communicator {communicator!r}")


def communication_time(
    communicator: str,
    nodes: int,
    nbytes: float,
    exchanges: float,
    alpha: float,
    beta: float,
    dense_bytes: float = math.inf,
    node: Node | None = None,
) -> float:
    """Seconds per step to move ``nbytes`` (this rank's payload, per step) in ``exchanges``
    exchanges with ``communicator`` among ``nodes`` ranks. ``hierarchical:C`` adds the dense
    reduce and broadcast inside nodes of ``node = (ranks, β inside)``."""
    if communicator.startswith("hierarchical:"):
        ranks, node_beta = node or (1, 0.0)
        inside = ring_allreduce(ranks, dense_bytes, 0.0, node_beta) + dense_bytes * node_beta * (ranks > 1)
        outer = communicator.split(":", 1)[1]
        return inside + communication_time(outer, nodes, nbytes, exchanges, alpha, beta, dense_bytes)
    terms = cost(communicator, nodes, nbytes, dense_bytes)
    return exchanges * terms.steps * alpha + terms.wire * beta


# -- overlap ------------------------------------------------------------------------------
BACKWARD_SHARE = 2 / 3  # backward ≈ 2× forward (its two matrix products per layer to forward's one)


def overlapped_step(
    compute_s: float, exchange_s: float, buckets: float, backward_share: float = BACKWARD_SHARE
) -> float:
    """Step time when the exchange overlaps the backward pass bucket by bucket (DDP's comm
    hook): the backward b = share·c produces B equal buckets, bucket i ready at
    f + i·b/B (f = c − b the forward), and one channel exchanges them in order, each taking
    X/B (X: the step's whole exchange, codec included). The last bucket ends at

        T = f + max_i (i·b/B + (B − i + 1)·X/B) = f + max(b/B + X, b + X/B)

    (the max of an affine function of i is at i = 1 or i = B): communication-bound, the
    channel starts after the first bucket and never idles; compute-bound, only the last
    bucket's exchange is left after backward. B = 1 is no overlap: T = c + X."""
    backward = backward_share * compute_s
    forward = compute_s - backward
    buckets = max(1.0, buckets)
    return forward + max(backward / buckets + exchange_s, backward + exchange_s / buckets)


def streaming_step(
    compute_s: float, fragment_s: float, inner_steps: int, fragments: int = 1, delay: int = 0, head_start: float = 0.0
) -> float:
    """Seconds per inner step of a schedule that exchanges its outer gradient as P =
    ``fragments`` fragments every H = ``inner_steps`` steps, each exchange (taking
    ``fragment_s``, codec included) overlapping τ = ``delay`` inner steps:

        T_H = max(H·c + P·max(0, X_f − τ·c − h),  P·X_f),   per step T_H / H

    The training thread waits at a fragment's due step for what τ steps of compute (and a
    head start h = ``head_start`` of the send step itself) did not hide; the second term is
    the channel's own limit (P exchanges per H steps, one at a time). DiLoCo is P = 1,
    τ = 0: (H·c + X)/H. grace_dgc forms Δ after the optimizer step, so h = 0; a layer-wise
    implementation (Streaming DiLoCo's simulator) starts a fragment's reduction as its
    layers finish the backward pass, h = the backward's share of c."""
    waiting = fragments * max(0.0, fragment_s - delay * compute_s - head_start)
    return max(inner_steps * compute_s + waiting, fragments * fragment_s) / inner_steps


def project_step(
    method: Method, nodes: int, alpha: float, beta: float, node: Node | None = None
) -> tuple[float, float]:
    """Projected seconds per step of one measured method (a dict of the summary's
    per-step figures: compute_s, compress_s, decompress_s, bytes_per_step,
    exchanges_per_step, rounds, communicator, workers), and the part of it that is not
    compute. A method run under a schedule (``schedule``: H inner steps, P fragments, delay
    τ) is projected by :func:`streaming_step` from one fragment's exchange; with
    ``overlap="backward"`` a per-step method by :func:`overlapped_step` over its buckets."""
    schedule = method.get("schedule") or {}
    params = schedule.get("params", {})
    inner = params.get("inner_steps", 1) if schedule else 1
    fragments = params.get("fragments", 1) if schedule.get("name") == "streaming_diloco" else 1
    delay = params.get("delay", 1) if schedule.get("name") == "streaming_diloco" else 0
    share = inner / fragments  # one fragment's exchange carries this many steps' worth of the averages
    exchanges = exchanges_per_step(method) * method.get("rounds", 1) * share
    communicator: str = method["communicator"]
    comm = communication_time(
        communicator,
        nodes,
        method["bytes_per_step"] * share,
        exchanges,
        alpha,
        beta,
        method.get("dense_bytes_per_step", math.inf) * share,
        node,
    )

    def per_rank(name: str) -> bool:  # one decompression per rank's payload
        return name.split(":", 1)[-1] in ("allgather", "broadcast")

    decompress = method["decompress_s"]  # measured at W workers: W payloads if per rank
    if per_rank(method.get("measured_communicator", communicator)):
        decompress = decompress / method["workers"]
    if per_rank(communicator):
        decompress = decompress * nodes
    exchange = (method["compress_s"] + decompress) * share + comm
    compute = method["compute_s"]
    if schedule:
        head_start = BACKWARD_SHARE * compute if method.get("overlap") == "backward" else 0.0
        step = streaming_step(compute, exchange, inner, fragments, delay, head_start)
    elif method.get("overlap") == "backward":
        step = overlapped_step(compute, exchange, exchanges_per_step(method))
    else:
        step = compute + exchange
    return step, comm * fragments / inner  # the communication per step, hidden or not


def exchanges_per_step(method: Method) -> float:
    """e of the model: the fusion groups the run exchanged per step (each one set of
    collectives), or its tensors for surveys that predate the groups' count."""
    return method.get("groups_per_step") or method["exchanges_per_step"]


def dense_step(compute_s: float, dense_bytes: float, exchanges: float, nodes: int, alpha: float, beta: float) -> float:
    return compute_s + ring_allreduce(nodes, dense_bytes, alpha, beta, exchanges)


# -- sharded training: an HSDP mesh -------------------------------------------------------------
def project_mesh(
    method: Method,
    shard: int,
    replicate: int,
    inter_alpha: float,
    inter_beta: float,
    intra_beta: float,
    seam: str = "shard",
) -> dict[str, float]:
    """Seconds per step of a method measured on FSDP2's reduce-scatter (a 1-D run of W ranks,
    ``examples/survey_fsdp.py``), projected onto an HSDP mesh of S = ``shard`` ranks inside a
    node (β_intra, latency ignored, as ``hierarchical``) × R = ``replicate`` nodes (α, β):

        G = the fp32 gradient bytes per rank and step (dense_bytes_per_step), r = the measured
        bytes_sent / G, C = r·G·W/(W−1) one rank's compressed gradient (headers included)
        all-gather   2 · (S−1)/S · G · β_intra     (FSDP unshards the parameters for forward and backward)
        reduce-scatter (S−1)/S · C · β_intra       (FSDP's own for ``none``: C = G)
        replicate    2(R−1)·e·α + 2(R−1)/R · (G/S) · β   (native HSDP: an fp32 ring allreduce of the shard)
        step         c + s + d + all-gather + reduce-scatter + replicate    (no overlap)

    ``seam="replicate"`` asks what the same compression buys across nodes instead: the
    reduce-scatter is FSDP's fp32 and the replicate exchange moves the compressed shard, C/S,
    through ``reduce_scatter``'s ring: 4(R−1)·e·α + 2(R−1)/R · (C/S) · β, the codec time charged there.
    """
    workers = method["workers"]
    dense = method["dense_bytes_per_step"]
    ratio = method["bytes_per_step"] / dense if dense else 1.0
    compressed = ratio * dense * workers / (workers - 1) if workers > 1 else dense
    share = (shard - 1) / shard
    exchanges = exchanges_per_step(method)
    if seam == "replicate":
        moved = 2 * (replicate - 1) / replicate * compressed / shard * inter_beta if replicate > 1 else 0.0
        across = 4 * (replicate - 1) * exchanges * inter_alpha + moved
        compressed = dense
    else:
        across = ring_allreduce(replicate, dense / shard, inter_alpha, inter_beta, exchanges)
    parts = {
        "all_gather": 2 * share * dense * intra_beta,
        "reduce_scatter": share * compressed * intra_beta,
        "replicate": across,
    }
    parts["step"] = method["compute_s"] + method["compress_s"] + method["decompress_s"] + sum(parts.values())
    return parts


def mesh_rows(
    methods: Sequence[Method],
    meshes: Sequence[tuple[int, int]],
    bandwidths_bps: Sequence[float],
    latency_ms: float,
    node_bps: float,
    seam: str = "shard",
) -> list[Row]:
    """:func:`project_mesh` for every reduce-scatter method, mesh and inter-node bandwidth;
    the speedup is against the ``none`` row on the same mesh."""
    measured = [m for m in methods if m["communicator"] == "reduce_scatter"]
    if not measured:
        raise GraceConfigError(
            "--mesh projects runs of FSDP2's reduce-scatter (communicator 'reduce_scatter', examples/survey_fsdp.py "
            "on a 1-D mesh); this survey has none"
        )
    rows = []
    for bandwidth in bandwidths_bps:
        for shard, replicate in meshes:
            parts = {
                m["label"]: project_mesh(m, shard, replicate, latency_ms / 1000, 8 / bandwidth, 8 / node_bps, seam)
                for m in measured
            }
            base = next((parts[m["label"]]["step"] for m in measured if m["compressor"] == "none"), None)
            for label, part in parts.items():
                rows.append(
                    {
                        "label": label,
                        "mesh": f"{shard}x{replicate}",
                        "bandwidth_bps": bandwidth,
                        **part,
                        "speedup": base / part["step"] if base else None,
                    }
                )
    return rows


def format_mesh(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| Method | Mesh (shard × replicate) | Inter-node bandwidth | Step | All-gather | Reduce-scatter | Replicate | "
        "Speedup vs none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speedup = "—" if r["speedup"] is None else f"{r['speedup']:.2f}×"
        lines.append(
            f"| {r['label']} | {r['mesh']} | {format_rate(r['bandwidth_bps'])} | {r['step'] * 1000:.2f} ms | "
            f"{r['all_gather'] * 1000:.2f} ms | {r['reduce_scatter'] * 1000:.2f} ms | {r['replicate'] * 1000:.2f} ms "
            f"| {speedup} |"
        )
    return "\n".join(lines)


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
def measured_methods(records: Sequence[dict[str, Any]]) -> list[Method]:
    """One entry per method label: mean over seeds of its unshaped runs at the largest
    measured worker count (shaped runs are used only when there is no unshaped one)."""
    from grace_dgc.registry import COMPRESSORS
    from grace_survey.running.results import latest_summaries

    runs = latest_summaries(records)
    if not runs:
        raise GraceConfigError("no finished runs (summary lines) in this directory; run `grace-dgc survey` first")
    local = [r for r in runs if r.get("network", "local") == "local"] or runs
    by_label: dict[str, list[dict[str, Any]]] = {}
    for run in local:
        by_label.setdefault(run["label"], []).append(run)
    methods = []
    for label, rows in by_label.items():
        workers = max(r["workers"] for r in rows)
        rows = [r for r in rows if r["workers"] == workers]
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
        methods.append(
            dict(
                mean,
                label=label,
                workers=workers,
                rounds=rounds,
                compressor=rows[0]["compressor"],
                schedule=rows[0].get("schedule"),
                communicator=modelled_name(rows[0]["communicator"], rows[0].get("params") or {}),
            )
        )
    return methods


def modelled_name(communicator: str, params: Mapping[str, Any]) -> str:
    """The model's name of a measured run's communicator (gTop-k is a mode of sparse_allreduce)."""
    return GTOPK if communicator == "sparse_allreduce" and params.get("global_topk") else communicator


def with_communicators(methods: Sequence[Method], communicators: Sequence[str]) -> list[Method]:
    """``methods`` plus, for each method and each of ``communicators`` that can carry its
    compressor, the same measured method projected with that communicator."""
    from grace_dgc.registry import COMMUNICATORS, COMPRESSORS

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


def project(
    methods: Sequence[Method],
    nodes_list: Sequence[int],
    bandwidths_bps: Sequence[float],
    latency_ms: float,
    node: Node | None = None,
) -> list[Row]:
    """Rows: (label, nodes, bandwidth, step time, communication, dense step time, speedup,
    samples/s). ``node = (ranks per node, bandwidth inside)`` models ``hierarchical:C``
    communicators, and the dense baseline as a hierarchical dense allreduce."""
    dense = next((m for m in methods if m["compressor"] == "none" and m["communicator"] == "allreduce"), None)
    if dense is not None and node is not None and node[0] > 1:
        dense = dict(dense, communicator="hierarchical:allreduce", measured_communicator="allreduce")
    node_model = None if node is None else (node[0], 8 / node[1])
    alpha = latency_ms / 1000
    rows = []
    for bandwidth in bandwidths_bps:
        beta = 8 / bandwidth
        for nodes in nodes_list:
            for method in methods:
                step, comm = project_step(method, nodes, alpha, beta, node_model)
                if dense is not None:  # the measured dense run, through the same model
                    dense_time = project_step(dense, nodes, alpha, beta, node_model)[0]
                else:
                    dense_time = dense_step(
                        method["compute_s"],
                        method["dense_bytes_per_step"],
                        exchanges_per_step(method),
                        nodes,
                        alpha,
                        beta,
                    )
                rows.append(
                    {
                        "label": method["label"],
                        "nodes": nodes,
                        "bandwidth_bps": bandwidth,
                        "latency_ms": latency_ms,
                        "step_s": step,
                        "communication_s": comm,
                        "dense_step_s": dense_time,
                        "speedup": dense_time / step,
                        "samples_per_s": None if method["batch_size"] is None else method["batch_size"] * nodes / step,
                        "utilization": method["compute_s"] / step,
                        "bytes_per_step": method["bytes_per_step"],
                        "measured_workers": method["workers"],
                    }
                )
    return rows


UTILIZATION_TARGETS = (0.90, 0.95)


def bandwidth_for_utilization(
    method: Method, nodes: int, latency_ms: float, target: float, node: Node | None = None
) -> float:
    """The bandwidth (bit/s) at which ``method`` spends ``target`` of its step computing on
    ``nodes`` nodes: compute c ÷ step time T = target. T is affine in β = 8/bandwidth (every
    collective's time is α-terms + bytes·β), so T(β) = T₀ + k·β and the largest β that
    meets c/T ≥ target is (c/target − T₀)/k. ``math.inf`` when no bandwidth reaches it
    (latency, compression or decompression alone take more than (1/target − 1)·c); 0 when
    any bandwidth does (nothing travels: one node)."""
    node_model = None if node is None else (node[0], 8 / node[1])
    alpha, probe = latency_ms / 1000, 1e-9
    if method.get("schedule") or method.get("overlap"):  # T(β) is piecewise affine: bisect
        return _bisect_bandwidth(
            lambda beta: project_step(method, nodes, alpha, beta, node_model)[0], method["compute_s"], target
        )
    base = project_step(method, nodes, alpha, 0.0, node_model)[0]
    slope = (project_step(method, nodes, alpha, probe, node_model)[0] - base) / probe
    room = method["compute_s"] / target - base
    if room < 0:
        return math.inf
    return 0.0 if slope <= 0 else 8 * slope / room


def _bisect_bandwidth(step: Any, compute_s: float, target: float) -> float:
    """The least bandwidth (bit/s) with compute_s / step(β) ≥ target, for a step time
    nondecreasing in β = 8/bandwidth: bisection on log β to a relative 1e-9."""
    if compute_s / step(0.0) < target:
        return math.inf
    low, high = 1e-18, 1e3  # β in s/byte: 8e18 bit/s down to 8 mbit/s … a byte per 1000 s
    if compute_s / step(high) >= target:
        return 8 / high
    for _ in range(200):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if compute_s / step(middle) >= target else (low, middle)
        if high / low < 1 + 1e-9:
            break
    return 8 / low


def utilization_rows(
    methods: Sequence[Method],
    nodes_list: Sequence[int],
    latencies_ms: Sequence[float],
    node: Node | None = None,
    targets: Sequence[float] = UTILIZATION_TARGETS,
) -> list[Row]:
    """Per method, node count and latency: the bandwidth each utilization target needs."""
    return [
        {
            "label": method["label"],
            "nodes": nodes,
            "latency_ms": latency,
            **{
                f"bandwidth_for_{round(target * 100)}pct_bps": bandwidth_for_utilization(
                    method, nodes, latency, target, node
                )
                for target in targets
            },
        }
        for latency in latencies_ms
        for nodes in nodes_list
        for method in methods
    ]


def _rate_or_never(bps: float) -> str:
    return "never" if math.isinf(bps) else "any" if bps == 0 else format_rate(float(f"{bps:.3g}"))


def format_utilization(rows: Sequence[Mapping[str, Any]], fractions: Sequence[float] = UTILIZATION_TARGETS) -> str:
    targets = [round(t * 100) for t in fractions]
    lines = [
        "| Method | Nodes | Latency | " + " | ".join(f"Bandwidth for {t} % utilization" for t in targets) + " |",
        "|---|---|---|" + "---|" * len(targets),
    ]
    for r in rows:
        needed = " | ".join(_rate_or_never(r[f"bandwidth_for_{t}pct_bps"]) for t in targets)
        lines.append(f"| {r['label']} | {r['nodes']} | {r['latency_ms']:g} ms | {needed} |")
    return "\n".join(lines)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| Method | Nodes | Bandwidth | Latency | Step time | Communication | Dense step | "
        "Speedup vs dense | Utilization | Samples/s | Bytes/step/worker |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['nodes']} | {format_rate(r['bandwidth_bps'])} | {r['latency_ms']:g} ms | "
            f"{r['step_s'] * 1000:.2f} ms | {r['communication_s'] * 1000:.2f} ms | "
            f"{r['dense_step_s'] * 1000:.2f} ms | {r['speedup']:.2f}× | {r['utilization']:.0%} | "
            f"{'n/a' if r['samples_per_s'] is None else format(r['samples_per_s'], '.0f')} | "
            f"{human_bytes(r['bytes_per_step'])} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[Mapping[str, Any]], path: str) -> str:
    from grace_survey.report.plots import pyplot, save

    plt = pyplot()
    bandwidths = sorted({r["bandwidth_bps"] for r in rows})
    latencies = sorted({r["latency_ms"] for r in rows})
    fig, axes = plt.subplots(
        len(latencies), len(bandwidths), figsize=(5 * len(bandwidths), 4 * len(latencies)), squeeze=False
    )
    panels = [(ax, b, lat) for row, lat in zip(axes, latencies) for ax, b in zip(row, bandwidths)]
    for ax, bandwidth, latency in panels:
        subset = [r for r in rows if r["bandwidth_bps"] == bandwidth and r["latency_ms"] == latency]
        for label in dict.fromkeys(r["label"] for r in subset):
            points = sorted((r["nodes"], r["speedup"]) for r in subset if r["label"] == label)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes")
        ax.set_ylabel("projected speedup over dense allreduce")
        ax.set_title(f"{format_rate(bandwidth)}, α = {subset[0]['latency_ms']:g} ms")
        ax.legend(fontsize=8)
    return save(plt, fig, path)


def add_project_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("dir", nargs="?", help="a survey output directory (results.jsonl)")
    parser.add_argument("--nodes", default="8,16,64", help="comma-separated node counts (default 8,16,64)")
    parser.add_argument("--bandwidth", default="1gbit,10gbit", help="comma-separated rates (default 1gbit,10gbit)")
    parser.add_argument(
        "--latency", default="0.1", help="per-message latency α in ms, comma-separated to sweep (default 0.1)"
    )
    parser.add_argument(
        "--rtt",
        help="round-trip times in ms instead of --latency, comma-separated (α = RTT/2; e.g. 1,50,500 for "
        "datacenter, cross-region and internet links)",
    )
    parser.add_argument(
        "--low-bandwidth",
        action="store_true",
        help="the low-bandwidth sweep: --bandwidth 0.1gbit,1gbit,10gbit --rtt 1,50,500 (cross-datacenter and "
        "internet settings, where DiLoCo-style training runs)",
    )
    parser.add_argument(
        "--communicators",
        default="",
        help="also project each method with these communicators, comma-separated "
        "(sparse_allreduce, reduce_scatter, allgather, hierarchical:<outer>, …)",
    )
    parser.add_argument("--group-size", type=int, default=1, help="ranks per node for hierarchical:<outer> (default 1)")
    parser.add_argument("--node-bandwidth", default="100gbit", help="bandwidth inside a node (default 100gbit)")
    parser.add_argument(
        "--overlap",
        choices=("none", "backward"),
        default="none",
        help="'backward': a per-step method's exchange overlaps the backward pass bucket by bucket (the DDP hook), "
        "and a schedule's starts as the backward produces it (a layer-wise implementation, Streaming DiLoCo's "
        "simulator); 'none' (default): after the step's compute, as DistributedOptimizer and grace_dgc's schedules "
        "run (streaming_diloco still hides each exchange behind its τ inner steps)",
    )
    parser.add_argument(
        "--utilization",
        default="90,95",
        help="compute-utilization targets in %%, comma-separated, for the bandwidth table (default 90,95)",
    )
    assume = parser.add_argument_group(
        "assumptions instead of a survey (Streaming DiLoCo's simulation, its Table 4): data-parallel, DiLoCo and "
        "Streaming DiLoCo built from a model size and a step time"
    )
    assume.add_argument("--assume-params", type=float, help="parameters of the model, e.g. 1e9 (then DIR is not read)")
    assume.add_argument("--step-time", type=float, default=0.1, help="compute seconds per inner step (default 0.1)")
    assume.add_argument("--inner-steps", type=int, default=100, help="H (default 100)")
    assume.add_argument("--fragments", type=int, default=2, help="Streaming DiLoCo's P (default 2)")
    assume.add_argument("--delay", type=int, default=1, help="Streaming DiLoCo's overlap τ in inner steps (default 1)")
    assume.add_argument("--bits", type=int, default=32, help="bits per parameter exchanged (default 32)")
    assume.add_argument("--outer-bits", type=int, default=4, help="bits of the quantized outer gradient (default 4)")
    assume.add_argument("--buckets", type=int, default=25, help="data-parallel's gradient buckets (default 25)")
    parser.add_argument(
        "--mesh",
        help="HSDP meshes SHARDxREPLICATE, comma-separated (e.g. 8x4,8x16): project the survey's FSDP2 reduce-scatter "
        "runs onto them, shard ranks inside a node at --node-bandwidth, replicas across nodes at --bandwidth",
    )
    parser.add_argument(
        "--seam",
        choices=("shard", "replicate"),
        default="shard",
        help="with --mesh: where the measured compression acts, on FSDP's reduce-scatter inside a node (shard, "
        "as measured) or on the exchange across nodes (replicate)",
    )
    parser.add_argument("--out", help="where to write projection.{md,csv,png} (default: DIR)")
    return parser


def run_project(args: argparse.Namespace) -> int:
    from grace_survey.running.results import read_records

    assumed = getattr(args, "assume_params", None)
    if assumed is None and (args.dir is None or not os.path.isdir(args.dir)):
        raise GraceConfigError(f"{args.dir!r} is not a directory (give a survey's directory, or --assume-params N)")
    try:
        nodes = [int(n) for n in str(args.nodes).split(",") if n.strip()]
    except ValueError:
        raise GraceConfigError(f"--nodes {args.nodes!r} must be comma-separated integers, e.g. 8,16,64") from None
    if not nodes or min(nodes) < 1:
        raise GraceConfigError(f"--nodes {args.nodes!r} must be integers >= 1")
    if getattr(args, "low_bandwidth", False):
        args.bandwidth, args.rtt = "0.1gbit,1gbit,10gbit", "1,50,500"
    bandwidths = [parse_rate(b) for b in str(args.bandwidth).split(",") if b.strip()]
    if getattr(args, "rtt", None):
        latencies = [parse_latency(r) / 2 for r in str(args.rtt).split(",") if r.strip()]
    else:
        latencies = [parse_latency(a) for a in str(args.latency).split(",") if a.strip()]
    if not bandwidths or not latencies:
        raise GraceConfigError("--bandwidth and --latency (or --rtt) need at least one value each")
    try:
        targets = [float(t) / 100 for t in str(getattr(args, "utilization", "90,95")).split(",") if t.strip()]
    except ValueError:
        targets = []
    if not targets or not all(0 < t < 1 for t in targets):
        raise GraceConfigError(f"--utilization {args.utilization!r}: percentages in (0, 100), e.g. 50,90")
    if assumed is not None:
        methods = assumed_methods(
            assumed,
            args.step_time,
            max(nodes),
            args.inner_steps,
            args.fragments,
            args.delay,
            args.bits,
            args.outer_bits,
            args.buckets,
        )
    else:
        methods = measured_methods(read_records(args.dir))
    if getattr(args, "overlap", "none") == "backward":
        methods = [dict(m, overlap="backward") for m in methods]
    if getattr(args, "mesh", None):
        return _run_mesh(args, methods, bandwidths, latencies)
    extra = [c.strip() for c in str(getattr(args, "communicators", "") or "").split(",") if c.strip()]
    if extra:
        methods = with_communicators(methods, extra)
    group = getattr(args, "group_size", 1) or 1
    if group < 1:
        raise GraceConfigError(f"--group-size {group} must be >= 1")
    node = (group, parse_rate(getattr(args, "node_bandwidth", "100gbit")))
    rows = [row for latency in latencies for row in project(methods, nodes, bandwidths, latency, node)]
    needs = utilization_rows(methods, nodes, latencies, node, targets)
    out = args.out or args.dir or "."
    os.makedirs(out, exist_ok=True)
    table = format_table(rows) + "\n\n" + format_utilization(needs, targets)
    with open(os.path.join(out, "projection.md"), "w") as f:
        f.write(
            "# Projected step time and speedup over dense allreduce\n\n"
            "α-β model (see `grace_survey.projection.project`); compute, compress/decompress times and "
            "payload bytes measured by the survey. Utilization: compute time ÷ step time. The second "
            "table: the bandwidth each method needs to keep that share of its step computing "
            "(never: latency or compression alone prevent it).\n\n" + table + "\n"
        )
    with open(os.path.join(out, "projection.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, os.path.join(out, "projection.png"))
    print(table)
    print(f"\nwrote {os.path.join(out, 'projection.md')}, projection.csv, projection.png")
    return 0


def _run_mesh(args: argparse.Namespace, methods: list[Method], bandwidths: list[float], latencies: list[float]) -> int:
    meshes = []
    for text in str(args.mesh).split(","):
        try:
            shard, replicate = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise GraceConfigError(f"--mesh {text!r}: SHARDxREPLICATE, e.g. 8x16") from None
        if shard < 1 or replicate < 1:
            raise GraceConfigError(f"--mesh {text!r}: both sizes must be >= 1")
        meshes.append((shard, replicate))
    node_bps = parse_rate(getattr(args, "node_bandwidth", "100gbit"))
    seam = getattr(args, "seam", "shard")
    rows = [r for latency in latencies for r in mesh_rows(methods, meshes, bandwidths, latency, node_bps, seam)]
    table = format_mesh(rows)
    out = args.out or args.dir or "."
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "projection-mesh.md"), "w") as f:
        f.write(
            "# Sharded training projected onto HSDP meshes\n\nSee `grace_survey.projection.project.project_mesh`.\n\n"
            + table
            + "\n"
        )
    print(table)
    print(f"\nwrote {os.path.join(out, 'projection-mesh.md')}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_project_args(
        argparse.ArgumentParser(
            prog="grace-dgc project", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
    )
    return run_project(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
