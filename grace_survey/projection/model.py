"""The α-β cost model of ``grace-dgc project`` (its formulas: :mod:`grace_survey.projection.project`):
the collectives' costs, a measured method's step time on N nodes (:func:`project_step`, with
the backward-overlap and streaming schedules), the projected rows against dense allreduce
(:func:`project`), HSDP meshes (:func:`project_mesh`) and the bandwidth a compute
utilization needs (:func:`bandwidth_for_utilization`)."""

import math
from collections.abc import Sequence
from typing import Any

# the per-communicator steps and bytes are each communicator's own, read through the core's model
from grace_dgc.costmodel import cost
from grace_dgc.errors import GraceConfigError

Method = dict[str, Any]  # one measured method: the summary's per-step figures (see project_step)
Row = dict[str, Any]  # one projected row (see project)
Node = tuple[int, float]  # (ranks per node, bandwidth or β inside a node)


# -- the cost model: every formula and byte count is the communicators' own declaration --------
def counted_bytes(communicator: str, nodes: int, nbytes: float, dense_bytes: float) -> tuple[float, float]:
    """``(bytes_sent, bytes_received)`` the engine counts on one rank for one exchange of a
    payload of ``nbytes`` (size headers aside), as ``communicator`` declares them in its
    :meth:`~grace_dgc.interfaces.Communicator.cost`: what a test compares with ``grace.stats()``."""
    terms = cost(communicator, nodes, nbytes, dense_bytes)
    if terms.sent is None or terms.received is None:
        raise GraceConfigError(
            f"communicator {communicator!r} declares no byte count (Cost.sent and Cost.received of its cost())"
        )
    return terms.sent, terms.received


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
        inside = communication_time("allreduce", ranks, dense_bytes, 1, 0.0, node_beta)
        inside += dense_bytes * node_beta * (ranks > 1)
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
    return compute_s + communication_time("allreduce", nodes, dense_bytes, exchanges, alpha, beta)


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
        across = communication_time("reduce_scatter", replicate, compressed / shard, exchanges, inter_alpha, inter_beta)
        compressed = dense
    else:
        across = communication_time("allreduce", replicate, dense / shard, exchanges, inter_alpha, inter_beta)
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


# -- the projected rows, against dense allreduce -------------------------------------------
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
                        # the method's own measured compute, when the projection used the workload's
                        "own_compute_s": method.get("own_compute_s", method["compute_s"]),
                        "compute_flagged": bool(method.get("compute_flagged", False)),
                    }
                )
    return rows


# -- the bandwidth a compute utilization needs ---------------------------------------------
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
