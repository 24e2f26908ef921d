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
(forward + backward: the same for every method of a workload, the median of all its runs,
since a method changes the exchange and not the model and one run's compute on a busy
machine is noise; each method's own is shown beside it, flagged when it lies outside the
runs' noise), compress s, decompress d (measured at W workers), payload bytes b
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
with the shared compute and B the method's measured fp32 bytes per step (its e). Speedup =
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

from grace_dgc.errors import GraceConfigError
from grace_survey.projection.methods import (
    assumed_methods,
    measured_methods,
    modelled_name,
    shared_compute,
    with_communicators,
)
from grace_survey.projection.model import (
    BACKWARD_SHARE,
    UTILIZATION_TARGETS,
    Method,
    Node,
    Row,
    bandwidth_for_utilization,
    communication_time,
    counted_bytes,
    dense_step,
    exchanges_per_step,
    mesh_rows,
    overlapped_step,
    project,
    project_mesh,
    project_step,
    streaming_step,
    utilization_rows,
)
from grace_survey.report.conditions import launch_lines
from grace_survey.report.plots import pyplot, save
from grace_survey.running.results import current_runs, latest_summaries, read_grid, read_records
from grace_survey.units import format_rate, human_bytes, parse_latency, parse_rate

__all__ = [  # the command's own, then the model's and the methods' (this module held them before issue 41)
    "add_project_args",
    "compute_lines",
    "format_mesh",
    "format_table",
    "format_utilization",
    "main",
    "plot",
    "run_project",
    "BACKWARD_SHARE",
    "UTILIZATION_TARGETS",
    "Method",
    "Node",
    "Row",
    "assumed_methods",
    "bandwidth_for_utilization",
    "communication_time",
    "counted_bytes",
    "dense_step",
    "exchanges_per_step",
    "measured_methods",
    "mesh_rows",
    "modelled_name",
    "overlapped_step",
    "project",
    "project_mesh",
    "project_step",
    "shared_compute",
    "streaming_step",
    "utilization_rows",
    "with_communicators",
]


# -- tables and plot -----------------------------------------------------------------------
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
        "Speedup vs dense | Utilization | Samples/s | Bytes/step/worker | Own measured compute |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        own = r.get("own_compute_s")
        own_text = (
            "—"
            if own is None
            else f"{own * 1000:.2f} ms" + (" ⚠ outside the runs' noise" if r.get("compute_flagged") else "")
        )
        lines.append(
            f"| {r['label']} | {r['nodes']} | {format_rate(r['bandwidth_bps'])} | {r['latency_ms']:g} ms | "
            f"{r['step_s'] * 1000:.2f} ms | {r['communication_s'] * 1000:.2f} ms | "
            f"{r['dense_step_s'] * 1000:.2f} ms | {r['speedup']:.2f}× | {r['utilization']:.0%} | "
            f"{'n/a' if r['samples_per_s'] is None else format(r['samples_per_s'], '.0f')} | "
            f"{human_bytes(r['bytes_per_step'])} | {own_text} |"
        )
    return "\n".join(lines)


def compute_lines(methods: Sequence[Method]) -> list[str]:
    """What compute the projection used, per workload: the shared median, the runs' spread,
    and the methods whose own measurement lies outside the runs' noise."""
    seen: dict[int, tuple[dict[str, Any], list[Method]]] = {}
    for method in methods:
        if "compute" in method:  # measured (not assumed) methods
            seen.setdefault(id(method["compute"]), (method["compute"], []))[1].append(method)
    lines = []
    for reference, members in seen.values():
        lines.append(
            f"- **Compute: every method is projected on the same forward + backward, "
            f"{reference['median_s'] * 1000:.2f} ms**, the median of the workload's {reference['runs']} run(s) at "
            f"{members[0]['workers']} workers (every method, every seed; they measured "
            f"{reference['min_s'] * 1000:.2f}–{reference['max_s'] * 1000:.2f} ms). A method changes the exchange, "
            "not the model's compute; one run's compute is the machine's noise. Each method's compress, decompress "
            "and error-feedback times and its bytes are its own."
        )
        flagged = [m for m in members if m.get("compute_flagged")]
        if flagged:
            shown = ", ".join(f"{m['label']} ({m['own_compute_s'] * 1000:.2f} ms)" for m in flagged)
            lines.append(
                f"- **⚠ Own compute outside the runs' noise** (more than {reference['tolerance_s'] * 1000:.2f} ms from "
                f"the median): {shown}. The machine was busy during those runs, or the method works on the training "
                "thread (the DDP hook compresses inside the backward); they are projected on the shared compute, "
                "not ranked on their own. Rerun them on a quiet machine to tell which."
            )
    return lines


def plot(rows: Sequence[Mapping[str, Any]], path: str) -> str:
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


# -- the command line ----------------------------------------------------------------------
def add_project_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _add_sweep_args(parser)
    _add_communication_args(parser)
    _add_assumption_args(parser)
    _add_mesh_args(parser)
    parser.add_argument("--out", help="where to write projection.{md,csv,png} (default: DIR)")
    return parser


def _add_sweep_args(parser: argparse.ArgumentParser) -> None:
    """What is projected onto what: the survey, the node counts, bandwidths and latencies."""
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


def _add_communication_args(parser: argparse.ArgumentParser) -> None:
    """Other communicators, the nodes' insides, overlap and the utilization targets."""
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


def _add_assumption_args(parser: argparse.ArgumentParser) -> None:
    """A model size and a step time instead of a survey (Streaming DiLoCo's simulation)."""
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


def _add_mesh_args(parser: argparse.ArgumentParser) -> None:
    """HSDP meshes for the survey's FSDP2 reduce-scatter runs."""
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


def run_project(args: argparse.Namespace) -> int:
    assumed = getattr(args, "assume_params", None)
    if assumed is None and (args.dir is None or not os.path.isdir(args.dir)):
        raise GraceConfigError(f"{args.dir!r} is not a directory (give a survey's directory, or --assume-params N)")
    nodes = _node_counts(args)
    bandwidths, latencies = _links(args)
    targets = _utilization_targets(args)
    methods = _methods(args, nodes)
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
    notes = compute_lines(methods)
    if assumed is None:
        notes += [line for line in launch_lines(latest_summaries(_current_records(args.dir))) if "Warning" in line]
    _write_projection(args.out or args.dir or ".", rows, needs, targets, notes)
    return 0


def _node_counts(args: argparse.Namespace) -> list[int]:
    try:
        nodes = [int(n) for n in str(args.nodes).split(",") if n.strip()]
    except ValueError:
        raise GraceConfigError(f"--nodes {args.nodes!r} must be comma-separated integers, e.g. 8,16,64") from None
    if not nodes or min(nodes) < 1:
        raise GraceConfigError(f"--nodes {args.nodes!r} must be integers >= 1")
    return nodes


def _links(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """The bandwidths (bit/s) and latencies α (ms) swept; ``--low-bandwidth`` sets both."""
    if getattr(args, "low_bandwidth", False):
        args.bandwidth, args.rtt = "0.1gbit,1gbit,10gbit", "1,50,500"
    bandwidths = [parse_rate(b) for b in str(args.bandwidth).split(",") if b.strip()]
    if getattr(args, "rtt", None):
        latencies = [parse_latency(r) / 2 for r in str(args.rtt).split(",") if r.strip()]
    else:
        latencies = [parse_latency(a) for a in str(args.latency).split(",") if a.strip()]
    if not bandwidths or not latencies:
        raise GraceConfigError("--bandwidth and --latency (or --rtt) need at least one value each")
    return bandwidths, latencies


def _utilization_targets(args: argparse.Namespace) -> list[float]:
    try:
        targets = [float(t) / 100 for t in str(getattr(args, "utilization", "90,95")).split(",") if t.strip()]
    except ValueError:
        targets = []
    if not targets or not all(0 < t < 1 for t in targets):
        raise GraceConfigError(f"--utilization {args.utilization!r}: percentages in (0, 100), e.g. 50,90")
    return targets


def _methods(args: argparse.Namespace, nodes: Sequence[int]) -> list[Method]:
    """The methods to project: assumed (``--assume-params``) or the survey's, with ``--overlap``."""
    if getattr(args, "assume_params", None) is not None:
        methods = assumed_methods(
            args.assume_params,
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
        methods = measured_methods(_current_records(args.dir))
    if getattr(args, "overlap", "none") == "backward":
        methods = [dict(m, overlap="backward") for m in methods]
    return methods


def _current_records(out_dir: str) -> list[dict[str, Any]]:
    """The records of the grid the last survey into ``out_dir`` ran (as its report reads them:
    runs of other settings or methods no longer in the config are left out)."""
    return current_runs(read_records(out_dir), read_grid(out_dir))[0]


def _write_projection(
    out: str, rows: Sequence[Row], needs: Sequence[Row], targets: Sequence[float], notes: Sequence[str] = ()
) -> None:
    """projection.md (what it was computed on, both tables), projection.csv (the rows) and
    projection.png; the notes and tables printed."""
    os.makedirs(out, exist_ok=True)
    table = "\n".join(notes) + "\n\n" * bool(notes) + format_table(rows) + "\n\n" + format_utilization(needs, targets)
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
