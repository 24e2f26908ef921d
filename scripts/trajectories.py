"""Every way in, trained on 2 gloo ranks, recorded bit for bit: a refactor of the training wing
must leave each trajectory unchanged (issue 55, item 5).

    python scripts/trajectories.py record before.pt       # on the old commit
    python scripts/trajectories.py record after.pt        # on the new one
    python scripts/trajectories.py compare before.pt after.pt
    python scripts/trajectories.py resume before.pt       # the old checkpoints load in the new code

``record`` trains each way in (DistributedOptimizer, the DDP hook, FSDP2's reduce-scatter, the
six schedules) for 7 steps with a method that keeps state, and saves on every rank the
parameters after every step, the stats' counters and the state_dict after step 4. ``compare``
asks every tensor and counter to be equal (``torch.equal``); ``resume`` loads each saved
state_dict into a fresh way in of the current code, trains steps 5-7 and asks the parameters to
equal the recorded ones. Only the public API is used (``grace_dgc.*``), so one script runs on
both sides of a move.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from typing import Any

import torch

STEPS, CUT, WORLD = 7, 4, 2

# way in -> (compressor, memory, communicator, build parameters, schedule parameters)
WAYS: dict[str, tuple[str, str, str, dict[str, Any], dict[str, Any]]] = {
    "optimizer": ("topk", "residual", "allgather", {"compress_ratio": 0.3}, {}),
    "optimizer_dgc": ("dgc", "dgc", "allgather", {"compress_ratio": 0.3, "momentum": 0.9}, {}),
    "ddp": ("qsgd", "residual", "allgather", {"quantum_num": 7}, {}),
    "fsdp": ("qsgd", "residual", "reduce_scatter", {"quantum_num": 7}, {}),
    "diloco": ("topk", "residual", "allgather", {"compress_ratio": 0.3}, {"inner_steps": 2}),
    "local_sgd": ("none", "none", "allreduce", {}, {"inner_steps": 3}),
    "sparseloco": (
        "chunk_topk>statq",
        "residual",
        "allgather",
        {"chunk": 16, "k": 4, "beta": 0.95},
        {"inner_steps": 2},
    ),
    "streaming_diloco": ("fp4", "none", "allgather", {}, {"inner_steps": 2, "fragments": 2}),
    "onebit_adam": ("onebit", "residual", "allgather", {}, {"freeze_step": 2}),
    "zero_one_adam": ("onebit", "residual", "allgather", {}, {"var_freeze_step": 3, "local_step_scaler": 4}),
}
ADAM = ("onebit_adam", "zero_one_adam")


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(STEPS)]


def build(way: str) -> tuple[Any, Any, Any, Any]:
    """(module trained, optimizer stepped, the object whose state_dict is the checkpoint, stats())"""
    import grace_dgc

    comp, mem, comm, params, settings = WAYS[way]
    net = model()
    grace = grace_dgc.build(comp, mem, comm, **params)
    if way.startswith("optimizer"):
        inner = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.0 if way == "optimizer_dgc" else 0.9)
        opt = grace_dgc.DistributedOptimizer(inner, grace, net.named_parameters(), fusion_bytes=256)
        return net, opt, opt, opt.grace.stats
    if way == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0005)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        state, hook = grace_dgc.ddp_comm_hook(grace, ddp, opt)
        ddp.register_comm_hook(state, hook)
        return ddp, opt, state, grace.stats
    if way == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        compression = grace_dgc.fsdp_compression(net, reduce_scatter=grace, optimizer=opt)
        return net, opt, compression, compression.stats
    if way in ADAM:
        inner = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    else:
        inner = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    opt = grace_dgc.schedules.create(way, inner, grace, net.named_parameters(), **settings)
    return net, opt, opt, opt.stats


def train(net: Any, opt: Any, rank: int, steps: range) -> list[list[torch.Tensor]]:
    seen = []
    for x, y in [batches(rank)[i] for i in steps]:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        seen.append([full(p) for p in net.parameters()])
    return seen


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def counters(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sorted(stats.items()) if not k.endswith("seconds") and isinstance(v, (int, float, str))}


def state_of(holder: Any, opt: Any, directory: str, way: str) -> Any:
    """The checkpoint at the cut, as a file holds it (a state_dict shares live tensors): the way
    in's state, and the optimizer's where the way in does not hold it (the DDP hook, FSDP)."""
    if way == "fsdp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"grace": holder}, checkpoint_id=f"{directory}/{way}")
        return f"{directory}/{way}"
    buffer = io.BytesIO()
    torch.save({"way": holder.state_dict(), "optimizer": opt.state_dict() if opt is not holder else None}, buffer)
    return buffer.getvalue()


def set_parameters(net: Any, values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, value in zip(net.parameters(), values, strict=True):
            if hasattr(p, "full_tensor"):  # an FSDP2 shard: this rank's part of the recorded whole
                from torch.distributed.tensor import distribute_tensor

                p.to_local().copy_(distribute_tensor(value, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(value)


def record_job(rank: int, world: int, directory: str) -> dict[str, Any]:
    out = {}
    for way in WAYS:
        net, opt, holder, stats = build(way)
        seen = train(net, opt, rank, range(CUT))
        state = state_of(holder, opt, directory, way)
        seen += train(net, opt, rank, range(CUT, STEPS))
        out[way] = {"params": seen, "counters": counters(stats()), "state": state}
    return out


def resume_job(rank: int, world: int, recorded: dict[str, Any]) -> dict[str, str]:
    verdicts = {}
    for way, saved in recorded[rank].items():
        net, opt, holder, _ = build(way)  # fresh: everything at the cut comes from the checkpoint
        set_parameters(net, saved["params"][CUT - 1])
        if way == "fsdp":
            import torch.distributed.checkpoint as dcp

            dcp.load({"grace": holder}, checkpoint_id=saved["state"])
        else:
            checkpoint = torch.load(io.BytesIO(saved["state"]), weights_only=True)
            holder.load_state_dict(checkpoint["way"])
            if checkpoint["optimizer"] is not None:
                opt.load_state_dict(checkpoint["optimizer"])
        seen = train(net, opt, rank, range(CUT, STEPS))
        same = all(torch.equal(a, b) for step, ref in zip(seen, saved["params"][CUT:]) for a, b in zip(step, ref))
        verdicts[way] = "resumes bit for bit" if same else "DIFFERS after the resume"
    return verdicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("record", "compare", "resume"))
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    from grace_dgc.launch import run_local

    if args.action == "record":
        directory = tempfile.mkdtemp(prefix="trajectories-")
        results = run_local(record_job, WORLD, args=(directory,), timeout=600)
        torch.save(results, args.files[0])
        print(f"recorded {len(WAYS)} ways in on {WORLD} ranks into {args.files[0]} (dcp states in {directory})")
        return 0
    if args.action == "compare":
        before, after = (torch.load(f, weights_only=False) for f in args.files[:2])
        failures = 0
        for way in WAYS:
            same = all(
                torch.equal(a, b)
                for rank in range(WORLD)
                for step_a, step_b in zip(before[rank][way]["params"], after[rank][way]["params"], strict=True)
                for a, b in zip(step_a, step_b, strict=True)
            )
            same_counters = all(before[r][way]["counters"] == after[r][way]["counters"] for r in range(WORLD))
            failures += not (same and same_counters)
            verdict = f"parameters {'equal' if same else 'DIFFER'}, counters {'equal' if same_counters else 'DIFFER'}"
            print(f"{way:18s} {verdict}")
            if not same_counters:
                for r in range(WORLD):
                    a, b = before[r][way]["counters"], after[r][way]["counters"]
                    print("   ", {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)})
        return 1 if failures else 0
    recorded = torch.load(args.files[0], weights_only=False)
    verdicts = run_local(resume_job, WORLD, args=(recorded,), timeout=600)
    for way in WAYS:
        print(f"{way:18s} " + ", ".join(f"rank {r}: {v[way]}" for r, v in enumerate(verdicts)))
    return 0 if all("bit for bit" in v for verdict in verdicts for v in verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
