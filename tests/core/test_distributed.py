"""Real gloo process groups on localhost (2 and 3 ranks): aggregation for every valid
compressor × communicator pair, DistributedOptimizer sync, checkpoint/resume.

Each test spawns its ranks once and checks many cases inside (spawning costs seconds).
"""

import copy

import pytest
import torch
from method_params import PARAMS
from ranks import run_ranks

import grace_dgc
from grace_dgc.registry import COMMUNICATORS, COMPRESSORS

CLASSIC = ("allgather", "allreduce", "broadcast")


# methods whose aggregate is not a function of each rank's decoded tensor: demo averages each
# DCT coefficient over the ranks that sent it (DeMo's reference; tests/core/test_demo.py)
AGGREGATE_OF_PAYLOADS = ("demo",)


def valid_pairs():
    pairs = []
    for comp in COMPRESSORS.names():
        cls = COMPRESSORS.get(comp)
        # own tests: multi-round methods, and those a local copy cannot replay (a pre-round's
        # scale agreed over ranks: thc) or whose aggregate is not of decoded tensors
        if cls.rounds > 1 or cls.prerounds or comp in AGGREGATE_OF_PAYLOADS:
            continue
        for comm in CLASSIC:  # the collectives that move payloads as they are (new ones: test_aggregation)
            comm_cls = COMMUNICATORS.get(comm)
            allowed = getattr(cls, "communicators", None)
            if (comm_cls.needs_summable and not cls.summable) or (allowed and comm not in allowed):
                continue
            pairs.append((comp, comm))
    return pairs


def rank_input(rank, numel=37):
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(numel, generator=gen) * (rank + 1)
    if rank == 1:
        x[::2] = 0.0  # sparse on rank 1: threshold sends little there
    return x.reshape(-1, 1) if numel % 2 else x


def aggregate_job(rank, world_size, pairs):
    """Every pair: what grace.step returns, and what this rank alone contributed
    (an identical copy of its compressor, run locally)."""
    out = {}
    for comp, comm in pairs:
        grace = grace_dgc.build(comp, "none", comm, **PARAMS.get(comp, {}))
        x = rank_input(rank)
        local = copy.deepcopy(grace.compressor)
        payload, ctx = local.compress(x.clone(), "g")
        mine = local.decompress(payload, ctx)
        result = grace.step(x, "g")
        # an empty payload on some ranks must not hang: rank 0 sends nothing over threshold
        if comp == "threshold":
            empty = torch.zeros(10) if rank == 0 else torch.ones(10)
            extra = grace.step(empty, "e")
        else:
            extra = None
        out[(comp, comm)] = {
            "result": result,
            "mine": mine,
            "extra": extra,
            "wire_dtype": payload[0].dtype,
            "bytes": grace.stats()["bytes_sent"],
        }
    return out


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_valid_pair_aggregates_to_the_expected_average(world_size):
    pairs = valid_pairs()
    assert ("topk", "allgather") in pairs and ("none", "allreduce") in pairs
    assert ("topk", "allreduce") not in pairs
    results = run_ranks(aggregate_job, world_size, (pairs,))
    for pair in pairs:
        comp = COMPRESSORS.get(pair[0])(**PARAMS.get(pair[0], {}))
        per_rank = [r[pair] for r in results]
        expected = comp.aggregate([r["mine"] for r in per_rank])
        if comp.average:
            expected = expected / world_size
        # allreduce sums in the wire dtype (fp16/bf16 round at every partial sum)
        wire = per_rank[0]["wire_dtype"]
        eps = torch.finfo(wire).eps if wire.is_floating_point and pair[1] == "allreduce" else 0
        atol = 1e-6 + 2 * eps * world_size * float(expected.abs().max())
        for rank, r in enumerate(per_rank):
            assert torch.allclose(r["result"], expected, atol=atol), (pair, rank)
            assert torch.equal(r["result"], per_rank[0]["result"]), (pair, "ranks disagree")
        if pair[0] == "threshold":
            want = torch.ones(10) * (world_size - 1) / world_size
            assert all(torch.equal(r["extra"], want) for r in per_rank)


def test_bytes_on_the_wire_per_communicator():
    """2 ranks, topk k=11 of 37 (fp32 + int32) and the dense baseline."""
    results = run_ranks(aggregate_job, 2, ([("topk", "allgather"), ("topk", "broadcast"), ("none", "allreduce")],))
    header = 2 * 8
    assert [r[("topk", "allgather")]["bytes"] for r in results] == [header + 11 * 8] * 2
    # broadcast: a rank sends its header to the size allgather and its buffer once, as root
    assert [r[("topk", "broadcast")]["bytes"] for r in results] == [header + 11 * 8] * 2
    assert [r[("none", "allreduce")]["bytes"] for r in results] == [37 * 4] * 2


# -- DistributedOptimizer ------------------------------------------------------------


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(rank, steps, per_rank=6):
    gen = torch.Generator().manual_seed(7)
    data = [
        (torch.randn(per_rank * 3, 8, generator=gen), torch.randint(0, 3, (per_rank * 3,), generator=gen))
        for _ in range(steps)
    ]
    return [(x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]) for x, y in data]


def train(model, opt, data, scheduler=None):
    params = []
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    return params


def optimizer_job(rank, world_size):
    out = {}
    steps = 6
    data = batches(rank, steps)
    for comp, mem, comm, params in [
        ("none", "none", "allreduce", {}),
        ("topk", "residual", "allgather", {"compress_ratio": 0.2}),
        ("randomk", "residual", "allreduce", {"compress_ratio": 0.3}),
        ("threshold", "residual", "broadcast", {"threshold": 0.01}),
    ]:
        model = make_model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = grace_dgc.DistributedOptimizer(sgd, grace_dgc.build(comp, mem, comm, **params), model.named_parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        uninterrupted = train(model, opt, data, scheduler)
        assert sgd.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)

        # checkpoint after 3 steps, rebuild everything, load, continue
        model_a = make_model()
        opt_a = grace_dgc.DistributedOptimizer(
            torch.optim.SGD(model_a.parameters(), lr=0.1, momentum=0.9),
            grace_dgc.build(comp, mem, comm, **params),
            model_a.named_parameters(),
        )
        sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
        first = train(model_a, opt_a, data[:3], sched_a)
        checkpoint = copy.deepcopy(
            {"model": model_a.state_dict(), "opt": opt_a.state_dict(), "sched": sched_a.state_dict()}
        )
        model_b = make_model(seed=99)  # a different init, overwritten by the checkpoint
        opt_b = grace_dgc.DistributedOptimizer(
            torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9),
            grace_dgc.build(comp, mem, comm, **params),
            model_b.named_parameters(),
        )
        sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=2, gamma=0.5)
        model_b.load_state_dict(checkpoint["model"])
        opt_b.load_state_dict(checkpoint["opt"])
        sched_b.load_state_dict(checkpoint["sched"])
        resumed = first + train(model_b, opt_b, data[3:], sched_b)
        out[comp] = {"uninterrupted": uninterrupted, "resumed": resumed, "stats": opt.grace.stats()}

    # dense + allreduce equals one process doing SGD on the whole batch's mean gradient
    model = make_model()
    opt = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), grace_dgc.build(), model.named_parameters()
    )
    out["dense_plain"] = train(model, opt, data)

    # gradient accumulation over 2 backward passes
    model = make_model()
    opt = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        grace_dgc.build(),
        model.named_parameters(),
        backward_passes_per_step=2,
    )
    for x, y in data[:2]:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    out["accumulated"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    # broadcast helpers: rank-dependent init becomes rank 0's
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    grace_dgc.broadcast_parameters(model.state_dict(), root_rank=0)
    grace_dgc.broadcast_optimizer_state(opt, root_rank=0)
    out["broadcast"] = (
        torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        opt.state_dict()["state"][0]["momentum_buffer"],
    )
    return out


@pytest.mark.fast
def test_distributed_optimizer_sync_resume_and_reference():
    world_size = 3
    results = run_ranks(optimizer_job, world_size)
    for comp in ("none", "topk", "randomk", "threshold"):
        runs = [r[comp] for r in results]
        for step in range(6):  # bitwise-identical parameters on all ranks after every step
            for r in runs[1:]:
                assert torch.equal(r["uninterrupted"][step], runs[0]["uninterrupted"][step]), (comp, step)
        for r in runs:  # checkpoint → reload → continue equals an uninterrupted run
            assert all(torch.equal(a, b) for a, b in zip(r["uninterrupted"], r["resumed"])), comp
        assert runs[0]["stats"]["steps"] == 6
    assert results[0]["topk"]["stats"]["compression_ratio"] < 0.6

    # independent reference: one process, full batch (mean of the ranks' mean losses)
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    shards = [batches(r, 6) for r in range(world_size)]
    for step in range(6):
        sgd.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(model(s[step][0]), s[step][1]) for s in shards)
        (loss / world_size).backward()
        sgd.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert torch.allclose(results[0]["dense_plain"][step], flat, atol=1e-6)

    # accumulation: sum of 2 passes' gradients, averaged over ranks
    model = make_model()
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for s in shards:
        for x, y in s[:2]:
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads = [g + p.grad / world_size for g, p in zip(grads, model.parameters())]
    expected = torch.cat([(p.detach() - 0.1 * g).reshape(-1) for p, g in zip(model.parameters(), grads)])
    assert torch.allclose(results[0]["accumulated"], expected, atol=1e-6)

    for r in results[1:]:
        assert torch.equal(r["broadcast"][0], results[0]["broadcast"][0])
        assert torch.equal(r["broadcast"][1], results[0]["broadcast"][1])


def test_optimizer_bad_input_and_misuse():
    model = make_model()
    grace = grace_dgc.build(engine="local")
    with pytest.raises(grace_dgc.GraceConfigError, match="backward_passes_per_step=0; accepted"):
        grace_dgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grace, backward_passes_per_step=0)
    with pytest.raises(grace_dgc.GraceConfigError, match="duplicate names"):
        grace_dgc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), grace, [("w", p) for p in model.parameters()]
        )
    with pytest.raises(grace_dgc.GraceConfigError, match="must be a torch.optim.Optimizer"):
        grace_dgc.DistributedOptimizer(object(), grace)
    opt = grace_dgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grace, model.named_parameters())
    x = torch.randn(4, 8)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="computed again before step"):
        model(x).sum().backward()
    opt.synchronize()
    opt.step()
    # issue 55: the header every way in's state carries (the training wing's Driver), then what it holds
    assert set(opt.state_dict()) == {"format", "wrapper", "settings", "optimizer", "grace", "stats"}
    plain = torch.optim.SGD(model.parameters(), lr=0.1).state_dict()
    opt.load_state_dict(plain)  # a plain optimizer checkpoint also loads


def test_unused_parameter_gets_a_zero_gradient_exchange():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 1), "unused": torch.nn.Linear(3, 1)})
    opt = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), grace_dgc.build(engine="local"), model.named_parameters()
    )
    before = model["unused"].weight.detach().clone()
    model["used"](torch.ones(2, 3)).sum().backward()
    opt.step()
    assert torch.equal(model["unused"].weight, before)
    assert opt.grace.stats()["tensors"] == 4


def test_synchronize_then_step_exchanges_once_and_allows_clipping():
    model = make_model()
    opt = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), grace_dgc.build(engine="local"), model.named_parameters()
    )
    x, y = batches(0, 1)[0]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # acts on the averaged gradients
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert opt.grace.stats()["tensors"] == 4  # one exchange per parameter
    moved = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert float(moved) == pytest.approx(1e-3, rel=1e-4)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    with pytest.raises(RuntimeError, match="between synchronize\\(\\) and step\\(\\)"):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    with opt.skip_synchronize():
        opt.step()
    assert opt.grace.stats()["tensors"] == 8


# -- fusion groups --------------------------------------------------------------------

FUSION_CASES = [
    ("none", "none", "allreduce", {}),
    ("fp16", "none", "allreduce", {}),
    ("randomk", "residual", "allreduce", {"compress_ratio": 0.3}),
    ("topk", "residual", "allgather", {"compress_ratio": 0.3}),
    ("threshold", "residual", "broadcast", {"threshold": 0.8}),
    ("qsgd", "none", "allgather", {}),
    ("powersgd", "powersgd", "allreduce", {}),
    ("powersgd", "powersgd", "allgather", {}),
]


def group_inputs(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    tensors = [
        torch.randn(12, 10, generator=gen),
        torch.randn(7, generator=gen),
        torch.randn(3, 4, 5, generator=gen),
        torch.randn(9, generator=gen),
    ]
    if rank == 0:
        tensors[1] = torch.zeros(7)  # threshold: an empty payload inside the group
    return tensors


def fusion_job(rank, world_size):
    out = {}
    names = ["w1", "b1", "w2", "b2"]
    for comp, mem, comm, params in FUSION_CASES:
        fused, alone = (grace_dgc.build(comp, mem, comm, **params) for _ in range(2))
        fused_results, alone_results = [], []
        for step in range(3):  # several steps: memories and warm starts carry over
            tensors = group_inputs(rank, step)
            fused_results.append(fused.step_group_async([t.clone() for t in tensors], names).result())
            alone_results.append([alone.step(t.clone(), n) for t, n in zip(tensors, names)])
        out[comp, comm] = {
            "fused": fused_results,
            "alone": alone_results,
            "fused_bytes": fused.stats()["bytes_sent"],
            "alone_bytes": alone.stats()["bytes_sent"],
            "fused_steps": fused.stats()["steps"],
        }

    # DistributedOptimizer with fusion buckets equals one exchange per parameter
    params = {}
    for fusion_bytes in (0, 4 * 2**20, 256):
        model = make_model()
        opt = grace_dgc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.3),
            model.named_parameters(),
            fusion_bytes=fusion_bytes,
        )
        params[fusion_bytes] = (train(model, opt, batches(rank, 4)), len(opt._buckets))
    out["optimizer"] = params
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_fused_group_equals_one_exchange_per_tensor(world_size):
    results = run_ranks(fusion_job, world_size)
    for case in [(c[0], c[2]) for c in FUSION_CASES]:
        for r in results:
            for fused, alone in zip(r[case]["fused"], r[case]["alone"]):
                for a, b in zip(fused, alone):
                    # allreduce sums a fused buffer: with 3 ranks gloo may add in another order
                    if world_size == 2 or case[1] != "allreduce":
                        assert torch.equal(a, b), case
                    else:
                        # fp16 sums round at fp16's eps of the largest partial sum
                        atol = 4e-3 * float(b.abs().max()) if case[0] == "fp16" else 1e-6
                        assert torch.allclose(a, b, rtol=1e-5, atol=atol), case
            assert torch.equal(r[case]["fused"][-1][0], results[0][case]["fused"][-1][0]), (case, "ranks")
            assert r[case]["fused_steps"] == 3
        if case[1] == "allreduce":
            # no headers on allreduce: the same bytes, in one collective per dtype
            assert results[0][case]["fused_bytes"] == results[0][case]["alone_bytes"], case
    # allgather: a group pays its header per tensor once, but padding only on the group's total
    topk = results[0][("topk", "allgather")]
    assert topk["fused_bytes"] <= topk["alone_bytes"]
    for r in results:
        runs = r["optimizer"]
        assert runs[0][1] == 4 and runs[4 * 2**20][1] == 1 and runs[256][1] == 3
        for fusion_bytes in (4 * 2**20, 256):
            assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[fusion_bytes][0])), fusion_bytes


def test_fusion_bytes_is_validated():
    model = make_model()
    with pytest.raises(grace_dgc.GraceConfigError, match="fusion_bytes=-1; accepted: an int >= 0"):
        grace_dgc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), grace_dgc.build(engine="local"), fusion_bytes=-1
        )
