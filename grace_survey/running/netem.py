"""Emulated slow network: run commands in a private network namespace whose loopback is
shaped with ``tc``, so rank-to-rank traffic on 127.0.0.1 really is limited.

    run_shaped([python, "-m", ...], bandwidth_bps=1e9, latency_ms=0.1)

1. ``unshare --net`` (as root; otherwise ``unshare --user --map-root-user --net``, which
   works where unprivileged user namespaces are enabled) starts this module in a fresh
   network namespace: only its own loopback exists, nothing outside is touched;
2. inside, ``ip link set lo mtu 1500 up`` (Ethernet-sized frames: tbf's bucket must hold
   one frame, and 64 KiB loopback frames would make every packet a burst) and
   ``tc qdisc add dev lo root tbf rate R burst B latency 1s`` with
   B = max(64 KiB, 2 ms of traffic at R); with a latency, ``netem delay L`` is the root
   qdisc and tbf its child;
3. the command runs with ``GRACE_DGC_NETEM`` (the shaping, JSON) and
   ``GLOO_SOCKET_IFNAME=lo`` in its environment.

Semantics: R limits every frame leaving the loopback, headers included (TCP goodput is
about 95% of R with 1500-byte frames), and all ranks share it: R is the total rate of all
rank-to-rank traffic, like N hosts on one shared R link. For the symmetric collectives
(ring allreduce, allgather: every rank sends the same bytes at once) that equals N hosts
with their own R/N links, so to emulate a cluster whose hosts have B links give N·B
(measured: FC-heavy, 2 ranks, shaped 1gbit ran as ``grace-dgc project`` predicts for
2 nodes at 500mbit, within 3%). L is added to each packet once (a round trip takes 2·L).
NCCL bypasses the loopback, so shaped runs use gloo.

Needs root or CAP_NET_ADMIN (or user namespaces), ``unshare`` (util-linux), iproute2's
``ip`` and ``tc``, and the kernel's ``tbf`` (and, for a latency, ``netem``) qdiscs.
Without them :class:`NetemUnavailable` says what is missing and suggests
``grace-dgc project``, which projects the same comparison from measured figures.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, Literal, overload

from grace_dgc.errors import GraceConfigError
from grace_survey.units import format_rate, parse_latency, parse_rate

ENV = "GRACE_DGC_NETEM"
MTU = 1500
MIN_BURST = 64 * 1024


class NetemUnavailable(RuntimeError):
    """The shaped namespace cannot be created here; the message says why and what to do."""


def current_shaping() -> dict[str, Any] | None:
    """The shaping this process runs under (a dict), or None outside a shaped namespace."""
    value = os.environ.get(ENV)
    if not value:
        return None
    try:
        shaping = json.loads(value)
    except ValueError:
        shaping = None
    if not isinstance(shaping, dict):
        raise GraceConfigError(
            f"{ENV}={value[:80]!r} in the environment; accepted: the JSON object the survey sets "
            "(unset it: it is not a user setting)"
        )
    return shaping


def burst_bytes(bandwidth_bps: float) -> int:
    return int(max(MIN_BURST, bandwidth_bps / 8 * 0.002))


def shaping_commands(bandwidth_bps: float | None = None, latency_ms: float = 0.0) -> list[list[str]]:
    """The ``ip``/``tc`` commands that shape the namespace's loopback."""
    cmds = [f"ip link set lo mtu {MTU} up".split()]
    parent = "root"
    if latency_ms:
        cmds.append(f"tc qdisc add dev lo root handle 1: netem delay {latency_ms:g}ms limit 1000000".split())
        parent = "parent 1:1"
    if bandwidth_bps:
        rate, burst = int(bandwidth_bps), burst_bytes(bandwidth_bps)
        cmds.append(f"tc qdisc add dev lo {parent} handle 10: tbf rate {rate}bit burst {burst} latency 1s".split())
    return cmds


def describe(bandwidth_bps: float | None = None, latency_ms: float = 0.0) -> str:
    parts = [format_rate(bandwidth_bps)] if bandwidth_bps else []
    if latency_ms:
        parts.append(f"{latency_ms:g}ms")
    return "-".join(parts) or "local"


def _unshare_prefix() -> list[str]:
    if os.geteuid() == 0:
        return ["unshare", "--net", "--"]
    return ["unshare", "--user", "--map-root-user", "--net", "--"]


_SUGGESTION = (
    "Without it, project the comparison from measured figures instead: run the survey "
    "unshaped, then `grace-dgc project DIR --nodes 8,16,64 --bandwidth 1gbit,10gbit`."
)


def probe(bandwidth_bps: float | None = None, latency_ms: float = 0.0) -> None:
    """Try to create a shaped namespace (a second or so); raise :class:`NetemUnavailable`
    naming what is missing."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            package = "util-linux" if tool == "unshare" else "iproute2"
            raise NetemUnavailable(
                f"the emulated network needs `{tool}` ({package}), which is not on PATH. " + _SUGGESTION
            )
    script = " && ".join(" ".join(c) for c in shaping_commands(bandwidth_bps or 1e7, latency_ms))
    try:
        proc = subprocess.run(_unshare_prefix() + ["sh", "-c", script], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise NetemUnavailable("creating a shaped network namespace timed out. " + _SUGGESTION) from None
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip()
        if "unknown" in err.lower() and latency_ms:
            why = (
                "this kernel has no `netem` qdisc (CONFIG_NET_SCH_NETEM), needed for --latency; "
                "bandwidth shaping alone (tbf) may still work: drop --latency"
            )
        elif "unknown" in err.lower():
            why = "this kernel has no `tbf` qdisc (CONFIG_NET_SCH_TBF)"
        elif "not permitted" in err.lower() or "permission" in err.lower():
            why = (
                "creating a network namespace was refused: it needs root or CAP_NET_ADMIN "
                "(or unprivileged user namespaces, for `unshare --user --map-root-user --net`)"
            )
        else:
            why = "setting up the shaped loopback failed"
        raise NetemUnavailable(
            f"emulated network unavailable: {why} ({err or 'exit ' + str(proc.returncode)}). " + _SUGGESTION
        )


@overload
def run_shaped(
    argv: Sequence[str],
    bandwidth_bps: float | None = None,
    latency_ms: float = 0.0,
    capture: Literal[False] = False,
    timeout: float | None = None,
    check_first: bool = True,
) -> int: ...
@overload
def run_shaped(
    argv: Sequence[str],
    bandwidth_bps: float | None = None,
    latency_ms: float = 0.0,
    *,
    capture: Literal[True],
    timeout: float | None = None,
    check_first: bool = True,
) -> subprocess.CompletedProcess[str]: ...
def run_shaped(
    argv: Sequence[str],
    bandwidth_bps: float | None = None,
    latency_ms: float = 0.0,
    capture: bool = False,
    timeout: float | None = None,
    check_first: bool = True,
) -> int | subprocess.CompletedProcess[str]:
    """Run ``argv`` inside a fresh network namespace with a shaped loopback; returns the
    return code (or the CompletedProcess with ``capture``)."""
    if not (bandwidth_bps or latency_ms):
        raise ValueError("run_shaped needs a bandwidth or a latency")
    if check_first:
        probe(bandwidth_bps, latency_ms)
    cmd = _unshare_prefix() + [
        sys.executable,
        "-m",
        "grace_survey.running.netem",
        "_inside",
        "--bandwidth-bps",
        str(bandwidth_bps or 0),
        "--latency-ms",
        str(latency_ms or 0),
        "--",
        *argv,
    ]
    if capture:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return subprocess.run(cmd, timeout=timeout).returncode


def _inside(bandwidth_bps: float | None, latency_ms: float, argv: Sequence[str]) -> int:
    for cmd in shaping_commands(bandwidth_bps, latency_ms):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"[netem] `{' '.join(cmd)}` failed: {proc.stderr.strip()}", file=sys.stderr)
            return 3
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    env[ENV] = json.dumps(
        {"bandwidth_bps": bandwidth_bps or None, "latency_ms": latency_ms, "tag": describe(bandwidth_bps, latency_ms)}
    )
    return subprocess.run(argv, env=env).returncode


# -- measuring the link (used by the tests and by users checking their shaping) -------------
def _transfer_rank(rank: int, world_size: int, nbytes: int, repeats: int) -> list[float]:
    import torch
    import torch.distributed as dist

    payload = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(payload, 1)
        elif rank == 1:
            dist.recv(payload, 0)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def measure_transfer(nbytes: int = 1_000_000, repeats: int = 1) -> list[float]:
    """Seconds to move ``nbytes`` from rank 0 to rank 1 over gloo (barrier to barrier)."""
    from grace_dgc.launch import run_local

    return run_local(_transfer_rank, 2, (nbytes, repeats), timeout=120)[1]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_inside"]:
        sep = argv.index("--")
        parser = argparse.ArgumentParser()
        parser.add_argument("--bandwidth-bps", type=float, default=0)
        parser.add_argument("--latency-ms", type=float, default=0)
        args = parser.parse_args(argv[1:sep])
        return _inside(args.bandwidth_bps or None, args.latency_ms, argv[sep + 1 :])
    parser = argparse.ArgumentParser(
        prog="python -m grace_survey.running.netem", description="run a command on a shaped loopback, or measure one"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a command in a shaped network namespace")
    run.add_argument("--bandwidth", help="e.g. 1gbit, 100mbit")
    run.add_argument("--latency", default="0", help="one-way delay in ms")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command ...")
    measure = sub.add_parser("measure", help="time a transfer between two gloo ranks (prints JSON)")
    measure.add_argument("--bytes", type=int, default=1_000_000)
    measure.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "measure":
        seconds = measure_transfer(args.bytes, args.repeats)
        print(json.dumps({"bytes": args.bytes, "seconds": seconds, "shaping": current_shaping()}))
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the command after --")
    try:
        return run_shaped(cmd, parse_rate(args.bandwidth) if args.bandwidth else None, parse_latency(args.latency))
    except NetemUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
