"""One job, two engines: ``engine_job`` runs every compressor × communicator pair, the
engine's primitives and a short DistributedOptimizer run on whatever engine ``auto`` picks.

* under horovodrun: ``python tests/hvd_worker.py OUT_DIR`` calls ``hvd.init()`` (so ``auto``
  picks Horovod) and pickles this rank's results to ``OUT_DIR/rank<r>.pkl``;
* under :func:`grace_dgc.launch.run_local`: the same function on gloo (``auto`` → torch).

tests/core/test_horovod.py compares the two. Cases are listed at run time from the registries,
so methods added later are covered; a case that raises records its traceback (every rank
runs the same code on same-shaped data, so they fail at the same point and stay matched).
"""

import os
import pickle
import sys
import traceback

import torch
from method_params import PARAMS

import grace_dgc
from grace_dgc.registry import COMMUNICATORS, COMPRESSORS

STEPS = 2
# (memory, compressor, communicator) extra cases with error feedback
WITH_MEMORY = [("residual", "topk", "allgather"), ("residual", "randomk", "allreduce")]
# the communicators that aggregate in the collective (all_to_all, process sets), with their
# parameters: every compressor each accepts, plus these variants
AGGREGATING = {
    "sparse_allreduce": [{}, {"global_topk": True}],
    "reduce_scatter": [{}],
    "hierarchical": [{"group_size": 1, "outer": "allgather"}, {"group_size": 1, "outer": "reduce_scatter"}],
}
# hierarchical with one node of both ranks (dense inside, a world of one leader outside)
ONE_NODE = [("topk", "residual", "hierarchical", {"group_size": 2, "outer": "sparse_allreduce"})]


def cases():
    """Every valid (compressor, memory, communicator, params), built at run time."""
    out = []
    for comp in COMPRESSORS.names():
        cls = COMPRESSORS.get(comp)
        allowed = getattr(cls, "communicators", None)
        for comm in ("allgather", "allreduce", "broadcast"):
            if (COMMUNICATORS.get(comm).needs_summable and not cls.summable) or (allowed and comm not in allowed):
                continue
            out.append((comp, "none", comm, PARAMS.get(comp, {})))
        for comm, variants in AGGREGATING.items():
            if not COMMUNICATORS.get(comm).fits(cls()):
                continue
            for variant in variants:
                if COMMUNICATORS.get(variant.get("outer", comm)).fits(cls()):
                    out.append((comp, "none", comm, {**PARAMS.get(comp, {}), **variant}))
    out += [(comp, mem, comm, PARAMS.get(comp, {})) for mem, comp, comm in WITH_MEMORY]
    return out + ONE_NODE


def case_key(comp, mem, comm, params):
    """``compressor+memory+communicator``, with the communicator's own parameters in brackets."""
    extra = {k: v for k, v in params.items() if k not in PARAMS.get(comp, {})}
    return f"{comp}+{mem}+{comm}" + (f"[{','.join(f'{k}={v}' for k, v in sorted(extra.items()))}]" if extra else "")


def gradients(rank, step):
    """Deterministic per-rank gradients: a matrix, an odd-length vector and a 1-element one."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    grads = {
        "w": torch.randn(12, 10, generator=gen),
        "b": torch.randn(37, generator=gen) * (rank + 1),
        "s": torch.randn(1, generator=gen),
    }
    if rank == 1:
        grads["b"][::2] = 0.0  # different payload sizes per rank for variable-size methods
    return grads


def record_payloads(grace):
    """Wrap the communicator's exchange to log each payload's (tensor count, dtypes, numels);
    the aggregating communicators have no ``exchange`` (they log nothing, as before)."""
    log, exchange = [], getattr(grace.communicator, "exchange", None)
    if exchange is None:
        return log

    def logged(payload, name):
        log.append([(t.dtype, t.numel()) for t in payload])
        return exchange(payload, name)

    grace.communicator.exchange = logged
    return log


def run_case(rank, comp, mem, comm, params):
    grace = grace_dgc.build(comp, mem, comm, **params)  # engine="auto"
    log = record_payloads(grace)
    steps = []
    for step in range(STEPS):
        steps.append({name: grace.step(g, name) for name, g in gradients(rank, step).items()})
    return {"steps": steps, "bytes": grace.stats()["bytes_sent"], "payloads": log, "engine": grace.engine.name}


def primitives(engine):
    """The engine seam itself: uneven allgather, dtypes Horovod lacks, non-contiguous tensors."""
    rank, out = engine.rank, {}
    before = engine.bytes_sent
    out["gather_uneven"] = engine.allgather(
        torch.arange(rank + 2, dtype=torch.float32), sizes=[r + 2 for r in range(engine.size)]
    )
    out["gather_bf16"] = engine.allgather(torch.full((3,), rank + 0.5, dtype=torch.bfloat16))
    out["gather_bool"] = engine.allgather(torch.tensor([True, bool(rank)]))
    out["gather_empty"] = engine.allgather(torch.empty(0, dtype=torch.uint8), sizes=[0] * engine.size)
    out["gather_bytes"] = engine.bytes_sent - before
    out["sum_bf16"] = engine.allreduce(torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16) * (rank + 1))
    out["sum_int8"] = engine.allreduce(torch.tensor([100, -100, 7], dtype=torch.int8))
    out["sum_bool"] = engine.allreduce(torch.tensor([False, rank == 1, True]))
    out["sum_int64"] = engine.allreduce(torch.tensor([2**40 + rank]))
    strided = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)  # non-contiguous
    engine.broadcast(strided, root=engine.size - 1)
    out["bcast_strided"] = strided
    out["bcast_bf16"] = engine.broadcast(torch.full((4,), float(rank), dtype=torch.bfloat16), root=0)
    out["bcast_object"] = engine.broadcast_object({"from": rank, "t": torch.ones(2) * rank}, root=1)
    # all_to_all: rank r sends r + d + 1 elements to rank d; then one with nothing to send
    send = [rank + d + 1 for d in range(engine.size)]
    recv = [s + rank + 1 for s in range(engine.size)]
    sent, received = engine.bytes_sent, engine.bytes_received
    out["a2a_float"] = engine.all_to_all(torch.arange(sum(send), dtype=torch.float32) + 100 * rank, send, recv)
    out["a2a_bf16"] = engine.all_to_all(torch.full((sum(send),), rank + 0.5, dtype=torch.bfloat16), send, recv)
    out["a2a_empty"] = engine.all_to_all(torch.empty(0), [0] * engine.size, [0] * engine.size)
    out["a2a_counted"] = (engine.bytes_sent - sent, engine.bytes_received - received)
    engine.barrier()
    return out


def optimizer_run(rank, steps=3):
    """DistributedOptimizer (topk + residual over allgather), unchanged, on the auto engine."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.2)
    opt = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), grace, model.named_parameters()
    )
    grace_dgc.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(7 + rank)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 3, (6,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "losses": losses,
        "engine": grace.engine.name,
        "bytes": grace.stats()["bytes_sent"],
    }


def engine_job(rank, world_size):
    results = {"engine": grace_dgc.create_engine("auto").name, "cases": {}, "errors": {}}
    for comp, mem, comm, params in cases():
        key = case_key(comp, mem, comm, params)
        try:
            results["cases"][key] = run_case(rank, comp, mem, comm, params)
        except Exception:
            results["errors"][key] = traceback.format_exc()
    for part, job in (
        ("primitives", lambda: primitives(grace_dgc.create_engine("auto"))),
        ("optimizer", lambda: optimizer_run(rank)),
    ):
        try:
            results[part] = job()
        except Exception:
            results["errors"][part] = traceback.format_exc()
    return results


def expected_bytes(payload_log, communicator, engine):
    """Bytes one rank hands to collectives, from the logged payloads (this rank's only:
    Horovod's allgather is unpadded); None for communicators this rule does not know."""
    if communicator not in ("allreduce", "allgather", "broadcast"):
        return None
    total = 0
    for payload in payload_log:
        if communicator == "allreduce":  # Horovod sums bf16 in fp32 and small ints in int32
            widen = {torch.bfloat16: 4, torch.bool: 4, torch.uint8: 4, torch.int8: 4, torch.int16: 4}
            total += sum(n * (widen.get(d, d.itemsize) if engine == "horovod" else d.itemsize) for d, n in payload)
        elif communicator in ("allgather", "broadcast"):  # int64 size header + the bytes
            total += 8 * len(payload) + sum(n * d.itemsize for d, n in payload)
    return total


if __name__ == "__main__":
    import horovod.torch as hvd

    hvd.init(process_sets="dynamic")  # hierarchical forms process sets
    result = engine_job(hvd.rank(), hvd.size())
    with open(os.path.join(sys.argv[1], f"rank{hvd.rank()}.pkl"), "wb") as fh:
        pickle.dump(result, fh)
    hvd.shutdown()
