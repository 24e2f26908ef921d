"""Surviving a lost node: grace_dgc under torchft, run as printed.

    pip install 'grace_dgc[torchft]'
    python examples/train_torchft.py --groups 2 --kill 1:4

One process here is the lighthouse and starts the replica groups, one process each (one rank per
group, gloo on the CPU). ``--kill G:S`` kills group G (SIGKILL-like: ``os._exit``) at its own S-th
step (an inner step under DiLoCo), between steps; ``G:S:exchange`` kills it inside an exchange (in
grace's communication thread).
The others go on without it; it is started again ``--restart-after`` seconds later, takes a
healthy group's state at its first step (torchft's heal) and trains on with them. Each group
writes its parameters, its final loss and the steps it applied to ``--out``; at the end the
groups' parameters are equal bit for bit, or the script exits 1.

``--way diloco`` runs DiLoCo (4 inner steps per round) instead of the DistributedOptimizer,
``--way streaming_diloco`` Streaming DiLoCo (2 fragments, each every 4 steps, exchanged over 1),
``--way onebit_adam`` 1-bit Adam (3 dense warm-up steps, then the momentum through the Grace),
``--way zero_one_adam`` 0/1 Adam (3 variance steps, then rounds of up to 4 local steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def model_and_data(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``group``'s batch at ``step``: its own shard of a fixed regression task."""
    generator = torch.Generator().manual_seed(1000 * step + group)
    x = torch.randn(32, 16, generator=generator)
    return x, x @ torch.linspace(-1, 1, 16).unsqueeze(1)


def replica_group(args: argparse.Namespace) -> None:
    import grace_dgc
    from grace_dgc.engines.torchft_engine import TorchFTEngine
    from grace_dgc.training.torchft import fault_tolerant, group_manager

    torch.manual_seed(args.group)  # each group its own initial model: torchft's first heal makes them one
    manager = group_manager(f"group_{args.group}", args.lighthouse)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    engine = TorchFTEngine(manager)
    params = args.restart_params if args.attempt and args.restart_params else args.params
    grace = grace_dgc.build(args.compressor, args.memory, args.communicator, engine=engine, **params)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    if args.way == "diloco":
        way = grace_dgc.schedules.create("diloco", inner, grace, model.named_parameters(), inner_steps=4)
    elif args.way == "streaming_diloco":  # 2 fragments, each synchronized every 4 steps, its exchange over 1 step
        way = grace_dgc.schedules.create(
            "streaming_diloco", inner, grace, model.named_parameters(), inner_steps=4, fragments=2, delay=1
        )
    elif args.way == "onebit_adam":  # 3 dense warm-up steps, then the momentum through the Grace
        adam = torch.optim.AdamW(model.parameters(), lr=0.01)
        way = grace_dgc.schedules.create("onebit_adam", adam, grace, model.named_parameters(), freeze_step=3)
    elif args.way == "zero_one_adam":  # 3 variance steps, then rounds of local steps (1, 1, 2, 2, then 4 steps)
        adam = torch.optim.AdamW(model.parameters(), lr=0.01)
        way = grace_dgc.schedules.create(
            "zero_one_adam",
            adam,
            grace,
            model.named_parameters(),
            var_freeze_step=3,
            local_step_scaler=2,
            local_step_clipper=4,
        )
    else:
        way = grace_dgc.DistributedOptimizer(inner, grace, model.named_parameters())
    quorum = fault_tolerant(manager, way, model)
    if args.attempt == 0 and args.group != args.late:
        start_together(args)
    first_step = None  # the job's step at this process's first step: above 0 where it healed in late
    kill_group, kill_step, where = args.kill
    taken = 0  # this process's own steps: it dies at its kill_step-th, wherever the job is by then
    # the steps asked for, and then on until every group is back (a demo: a lost node rejoins before the end)
    while manager.current_step() < args.steps or manager.num_participants() < args.groups:
        taken += 1
        dying = args.attempt == 0 and args.group == kill_group and taken == kill_step
        if dying and where == "between":
            os._exit(9)
        way.zero_grad()  # the quorum: a group behind the others heals here, so its data follow
        if dying:  # inside an exchange: the communication thread dies in its next collective
            for collective in ("allreduce", "allgather", "all_to_all", "broadcast"):
                setattr(engine, collective, lambda *a, **k: os._exit(9))
        step = manager.current_step()
        x, y = model_and_data(args.group, step)
        if first_step is None:
            first_step = step
        if args.group == 0:  # the job's progress, for a group that starts late (--late)
            with open(os.path.join(args.out, "progress"), "w") as f:
                f.write(str(manager.current_step()))
        torch.nn.functional.mse_loss(model(x), y).backward()
        way.step()
        time.sleep(args.step_seconds)  # a real step's compute: time for a lost group to come back
    if args.way in (
        "diloco",
        "streaming_diloco",
        "zero_one_adam",
    ):  # the round in progress: every group ends on one model
        way.synchronize_now()
    x, y = model_and_data(99, 0)
    with torch.no_grad():
        final = float(torch.nn.functional.mse_loss(model(x), y))
    record = {
        "group": args.group,
        "attempt": args.attempt,
        "steps": manager.current_step(),
        "final_loss": final,
        "parameters": [p.detach().flatten().tolist() for p in model.parameters()],
        "stats": {k: v for k, v in way.stats().items() if isinstance(v, (int, float))},
        "first_step": first_step,
        "discarded": quorum.discarded,
        "healed": quorum.healed,
    }
    with open(os.path.join(args.out, f"group{args.group}.json"), "w") as f:
        json.dump(record, f)
    manager.shutdown(wait=False)


def start_together(args: argparse.Namespace) -> None:
    """Wait until every group started on time is up, as a job's launcher starts them: on a busy
    machine one group's imports can take seconds, and the others would train without it."""
    open(os.path.join(args.out, f"ready{args.group}"), "w").close()
    on_time = [g for g in range(args.groups) if g != args.late]
    while not all(os.path.exists(os.path.join(args.out, f"ready{g}")) for g in on_time):
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--kill", default="", help="G:S[:exchange] (empty: no failure)")
    parser.add_argument("--restart-after", type=float, default=2.0)
    parser.add_argument("--late", type=int, default=-1, help="a group that starts once group 0 has 3 steps")
    parser.add_argument(
        "--way",
        choices=["optimizer", "diloco", "streaming_diloco", "onebit_adam", "zero_one_adam"],
        default="optimizer",
    )
    parser.add_argument("--compressor", default="topk")
    parser.add_argument("--memory", default="residual")
    parser.add_argument("--communicator", default="allgather")
    parser.add_argument("--params", type=json.loads, default={"compress_ratio": 0.25})
    parser.add_argument("--restart-params", type=json.loads, default=None, help="the restarted group's own")
    parser.add_argument("--out", default="torchft-run")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--group", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--attempt", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    parts = args.kill.split(":") if args.kill else ["-1", "-1"]
    args.kill = (int(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else "between")
    if args.group >= 0:
        replica_group(args)
        return 0
    return lighthouse_and_groups(args, argv or sys.argv[1:])


def _progress(out: str) -> int:
    try:
        with open(os.path.join(out, "progress")) as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def lighthouse_and_groups(args: argparse.Namespace, argv: list[str]) -> int:
    from torchft.coordination import LighthouseServer

    os.makedirs(args.out, exist_ok=True)
    for group in range(args.groups):  # an earlier run's marks in the same folder
        if os.path.exists(os.path.join(args.out, f"ready{group}")):
            os.remove(os.path.join(args.out, f"ready{group}"))
    # a group silent for 2 s is out of the quorum (long enough for a slow start on a busy machine)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    address = "http://localhost:" + lighthouse.address().rsplit(":", 1)[1]

    def start(group: int, attempt: int) -> subprocess.Popen:
        extra = ["--group", str(group), "--attempt", str(attempt), "--lighthouse", address]
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, *extra])

    deadline = time.monotonic() + args.timeout
    groups = {g: start(g, 0) for g in range(args.groups) if g != args.late}
    pending_start: dict[int, float] = {}
    late = args.late >= 0  # started once group 0 has committed 3 steps: it heals in past step 0
    ok = True
    try:
        while groups or pending_start or late:
            if time.monotonic() > deadline:
                print(f"timeout: groups {sorted(groups)} still running", file=sys.stderr)
                ok = False
                break
            if late and _progress(args.out) >= 3:
                groups[args.late], late = start(args.late, 1), False
            for group, at in list(pending_start.items()):
                if time.monotonic() >= at:
                    groups[group] = start(group, 1)
                    del pending_start[group]
            for group, process in list(groups.items()):
                code = process.poll()
                if code is None:
                    continue
                del groups[group]
                if code == 9 and group == args.kill[0]:
                    print(f"group {group} was killed; it starts again in {args.restart_after:g} s", flush=True)
                    pending_start[group] = time.monotonic() + args.restart_after
                elif code != 0:
                    print(f"group {group} failed (exit {code}): stopping the others", file=sys.stderr)
                    ok = False
            if not ok:
                break
            time.sleep(0.05)
    finally:
        for process in groups.values():
            process.kill()
        lighthouse.shutdown()
    if not ok:
        return 1
    records = [json.load(open(os.path.join(args.out, f"group{g}.json"))) for g in range(args.groups)]
    same = all(r["parameters"] == records[0]["parameters"] for r in records)
    for r in records:
        print(f"group {r['group']}: {r['steps']} steps, final loss {r['final_loss']:.6f}")
    print("parameters equal on every group" if same else "parameters DIFFER between groups")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
