"""The communicators that aggregate in the collective (sparse_allreduce, reduce_scatter,
hierarchical, auto) on real gloo process groups of 2, 3 and 4 ranks: results against
allgather or against references computed here, ranks bitwise equal, no lost gradient mass,
empty payloads, and the byte counts of the projection model."""

import copy

import pytest
import torch
from ranks import run_ranks

import grace_dgc
from grace_dgc.communicators.reduce_scatter import Chunked
from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import COMMUNICATORS, COMPRESSORS

SPARSE = {
    "topk": {"compress_ratio": 0.2},
    "threshold": {"threshold": 1.0},
    "dgc": {"compress_ratio": 0.2, "min_compress_size": 8},  # the 5-element tensor goes dense
}
QUANTIZERS = ["qsgd", "terngrad", "natural", "twobit", "signsgd", "signum", "onebit", "efsignsgd", "fp16"]


def grads(rank, step=0):
    gen = torch.Generator().manual_seed(100 * rank + step)
    out = [torch.randn(13, 9, generator=gen), torch.randn(5, generator=gen) * (rank + 1), torch.randn(1, generator=gen)]
    if rank == 1:
        out[0][::2] = 0.0  # different payload sizes per rank
    return out


def sparse_job(rank, world):
    out = {}
    for comp, params in SPARSE.items():
        for mode in (False, True):
            ref = grace_dgc.build(comp, "none", "allgather", **params)
            new = grace_dgc.build(comp, "none", "sparse_allreduce", global_topk=mode, **params)
            x = grads(rank)
            local = copy.deepcopy(new.compressor)
            payloads = [local.compress(t.clone(), n)[0] for t, n in zip(x, "wbs")]
            out[(comp, mode)] = {
                "ref": ref.step_group_async(x, list("wbs")).result(),
                "got": new.step_group_async(x, list("wbs")).result(),
                "payloads": payloads,
            }
    # an empty payload on rank 0 (threshold sends nothing), twice
    grace = grace_dgc.build("threshold", "none", "sparse_allreduce", threshold=0.5)
    empty = torch.zeros(10) if rank == 0 else torch.full((10,), float(rank))
    out["empty"] = [grace.step(empty, "e") for _ in range(2)]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_allreduce_equals_allgather_and_gtopk_keeps_the_largest_of_the_sum(world):
    outs = run_ranks(sparse_job, world)
    for comp in SPARSE:
        plain = outs[0][(comp, False)]
        for ref, got in zip(plain["ref"], plain["got"]):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        for mode in (False, True):
            for rank in range(1, world):  # every rank holds the same bits
                for a, b in zip(outs[rank][(comp, mode)]["got"], outs[0][(comp, mode)]["got"]):
                    assert torch.equal(a, b)
        # gTop-k: the K largest |sum| of each sparse tensor, K = the largest k any rank sent
        gtopk = outs[0][(comp, True)]["got"]
        for t, (full, kept) in enumerate(zip(plain["ref"], gtopk)):
            sizes = [len(outs[r][(comp, True)]["payloads"][t]) for r in range(world)]
            if 1 in sizes:  # DGC's dense tensor: summed whole
                torch.testing.assert_close(kept, full)
                continue
            k = max(outs[r][(comp, True)]["payloads"][t][1].numel() for r in range(world))
            summed = full.reshape(-1) * world
            order = torch.argsort(summed.abs(), descending=True, stable=True)[:k]
            expected = torch.zeros_like(summed)
            expected[order] = summed[order]
            torch.testing.assert_close(kept.reshape(-1) * world, expected, rtol=1e-5, atol=1e-5)
    expected = sum(float(r) for r in range(world)) / world
    for rank in range(world):
        for step in outs[rank]["empty"]:
            torch.testing.assert_close(step, torch.full((10,), expected))


def gtopk_select_job(rank, world):
    """gTop-k's radix select over many shapes: small integers (ties at the threshold across
    owners), fp64, a ratio whose union is smaller than K, several tensors in one group."""
    out = []
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)  # the same shapes and k on every rank
        dtype = torch.float64 if seed % 3 == 2 else torch.float32
        sizes = [int(torch.randint(1, 60, (1,), generator=gen)) for _ in range(1 + seed % 3)]
        ratio = [0.05, 0.3, 0.9][seed % 3]
        mine = torch.Generator().manual_seed(1000 * seed + rank)
        if seed % 2:  # integers in [-3, 3]: many equal |sums|
            x = [torch.randint(-3, 4, (n,), generator=mine).to(dtype) for n in sizes]
        else:
            x = [torch.randn(n, generator=mine, dtype=dtype) for n in sizes]
        names = [f"t{i}" for i in range(len(x))]
        grace = grace_dgc.build("topk", "none", "sparse_allreduce", compress_ratio=ratio, global_topk=True)
        local = copy.deepcopy(grace.compressor)
        ks = [local.compress(t.clone(), n)[0][1].numel() for t, n in zip(x, names)]
        out.append({"x": x, "ks": ks, "got": grace.step_group_async(x, names).result()})
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_gtopk_radix_select_picks_the_k_largest_of_the_sum_ties_to_the_lowest_index(world):
    outs = run_ranks(gtopk_select_job, world)
    for case in range(len(outs[0])):
        for t, got in enumerate(outs[0][case]["got"]):
            for rank in range(1, world):
                assert torch.equal(outs[rank][case]["got"][t], got)
            # the reference: every rank's top-k payload scattered and summed, then the K largest
            parts = []
            for rank in range(world):
                x = outs[rank][case]["x"][t]
                keep = torch.argsort(x.abs(), descending=True, stable=True)[: outs[rank][case]["ks"][t]]
                parts.append(torch.zeros_like(x).index_put_((keep,), x[keep]))
            summed = torch.stack(parts).sum(0)
            k = max(outs[r][case]["ks"][t] for r in range(world))
            order = torch.argsort(summed.abs(), descending=True, stable=True)[:k]
            order = order[summed[order] != 0]  # an index nobody sent is not a candidate
            expected = torch.zeros_like(summed).index_put_((order,), summed[order])
            torch.testing.assert_close(got * world, expected, rtol=1e-6, atol=1e-6, msg=f"case {case}, tensor {t}")


def gtopk_memory_job(rank, world):
    """gTop-k with residual memory: what the aggregate dropped stays in each rank's memory."""
    grace = grace_dgc.build("topk", "residual", "sparse_allreduce", compress_ratio=0.1, global_topk=True)
    total_in, total_out = torch.zeros(40), torch.zeros(40)
    for step in range(4):
        g = torch.randn(40, generator=torch.Generator().manual_seed(10 * rank + step))
        total_in += g
        total_out += grace.step(g, "g")
    return total_in, total_out, grace.memory.residuals["g"]


def test_gtopk_loses_no_gradient_mass():
    outs = run_ranks(gtopk_memory_job, 2)
    sent = outs[0][1] * 2  # Σ_steps Σ_ranks sent = N · Σ averages
    assert torch.equal(outs[0][1], outs[1][1])
    torch.testing.assert_close(sent + outs[0][2] + outs[1][2], outs[0][0] + outs[1][0], rtol=1e-5, atol=1e-5)


def reduce_scatter_job(rank, world):
    out = {}
    for comp in QUANTIZERS:
        params = {"threshold": 0.5} if comp == "twobit" else {}
        memory = "efsignsgd" if comp == "efsignsgd" else "residual"
        ref = grace_dgc.build(comp, "none", "allgather", **params)
        new = grace_dgc.build(comp, memory, "reduce_scatter", **params)
        local = Chunked(copy.deepcopy(new.compressor), world)
        local.inner.bind(new.engine)
        steps, sums = [], [torch.zeros_like(t) for t in grads(rank)]
        mine = [local.compress(t.clone(), n) for t, n in zip(grads(rank, 0), "wbs")]
        for step in range(3):
            x = grads(rank, step)
            steps.append(new.step_group_async(x, list("wbs")).result())
            sums = [s + t for s, t in zip(sums, x)]
        out[comp] = {
            "ref": ref.step_group_async(grads(rank), list("wbs")).result(),
            "steps": steps,
            "sums": sums,
            "mine": mine,
            "memory": copy.deepcopy(getattr(new.memory, "residuals", {})),
            "owner": copy.deepcopy(new.communicator.errors),
        }
    grace = grace_dgc.build("qsgd", "none", "reduce_scatter")
    out["tiny"] = grace.step(torch.tensor([float(rank)]), "t")  # fewer elements than ranks: empty chunks
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter(world):
    outs = run_ranks(reduce_scatter_job, world)
    for comp in QUANTIZERS:
        for rank in range(1, world):
            for a, b in zip(outs[rank][comp]["steps"], outs[0][comp]["steps"]):
                for x, y in zip(a, b):
                    assert torch.equal(x, y), comp
        if comp in ("signsgd", "signum"):  # the majority vote travels exactly: allgather's result
            for x, y in zip(outs[0][comp]["steps"][0], outs[0][comp]["ref"]):
                assert torch.equal(x, y)
            continue
        # no gradient mass lost: Σ_t N·avg_t + Σ_r e_r + N·Σ_owners ε = Σ_t Σ_r g_r,t (ε is in
        # units of the average)
        grads_total = [sum(outs[r][comp]["sums"][t] for r in range(world)) for t in range(3)]
        sent = [world * sum(step[t] for step in outs[0][comp]["steps"]) for t in range(3)]
        for t, name in enumerate("wbs"):
            memories = sum(outs[r][comp]["memory"][name] for r in range(world))  # efsignsgd: lr = 1
            owners = torch.cat([outs[r][comp]["owner"][name].reshape(-1) for r in range(world)])
            torch.testing.assert_close(
                sent[t] + memories + world * owners.view(sent[t].shape), grads_total[t], rtol=1e-4, atol=1e-4
            )
    # the first step of a deterministic quantizer, recomputed here: owner j averages the
    # decompressed chunk j of every rank and requantizes it (no carried error yet)
    for comp in ("onebit", "twobit"):
        expected = []
        for t in range(3):
            local = Chunked(COMPRESSORS.get(comp)(**({"threshold": 0.5} if comp == "twobit" else {})), world)
            payload_ctx = [outs[r][comp]["mine"][t] for r in range(world)]
            chunks = []
            for j in range(world):
                parts = [local.split(p, c)[j] for p, c in payload_ctx]
                ctx = payload_ctx[0][1].parts[j]
                average = local.inner.decompress_aggregate(parts, ctx) / world
                requant, rctx = local.inner.compress(average, "x")
                chunks.append(local.inner.decompress(requant, rctx).reshape(-1))
            expected.append(torch.cat(chunks).view(outs[0][comp]["steps"][0][t].shape))
        for got, want in zip(outs[0][comp]["steps"][0], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for rank in range(world):
        assert outs[rank]["tiny"].shape == (1,)


def mixed_group_job(rank, world):
    gen = torch.Generator().manual_seed(rank)
    group = [
        torch.randn(37, generator=gen),
        torch.randn(5, generator=gen).half(),
        torch.randn(9, generator=gen).double(),
        torch.randn(1, generator=gen),
        torch.randn(3, generator=gen).double(),  # one pair per owner at 30 %
    ]
    names = list("abcde")
    out = {}
    for communicator, params in [
        ("allgather", {}),
        ("sparse_allreduce", {}),
        ("sparse_allreduce", {"global_topk": True}),
    ]:
        grace = grace_dgc.build("topk", "none", communicator, compress_ratio=0.3, **params)
        out[communicator, bool(params)] = grace.step_group_async([t.clone() for t in group], names).result()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_allreduce_of_a_group_mixing_dtypes_and_tiny_tensors(world):
    """Issue 20: an fp64 value whose (value, index) pair sat at a 12-byte stride could not be
    viewed back as fp64 (a crash on one rank, a timeout on the other)."""
    outs = run_ranks(mixed_group_job, world)
    for rank in range(world):
        for key, got in outs[rank].items():
            for x, y in zip(got, outs[0][key]):
                assert torch.equal(x, y), key
        for x, y in zip(outs[rank]["sparse_allreduce", False], outs[rank]["allgather", False]):
            assert x.dtype == y.dtype
            torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)


def empty_on_rank0_job(rank, world):
    out = {}
    for n in (1, 2, 3, 37):
        x = torch.zeros(n) if rank == 0 else torch.randn(n, generator=torch.Generator().manual_seed(rank + n))
        for communicator, params in [("allgather", {}), ("sparse_allreduce", {}), ("sparse_allreduce", {"gtopk": 1})]:
            kwargs = {"global_topk": True} if params else {}
            grace = grace_dgc.build("threshold", "none", communicator, threshold=0.5, timeout=30, **kwargs)
            out[communicator, bool(params), n] = grace.step(x.clone(), f"t{n}")
    return out


def test_a_rank_with_an_empty_payload_and_no_region_takes_part_in_every_collective():
    """Issue 20: on 3 ranks, rank 0 sent no pair and owned no index (n < 3), so its engine
    skipped the all_to_all and met the others in their next collective: a hang."""
    outs = run_ranks(empty_on_rank0_job, 3)
    for key, got in outs[0].items():
        for rank in (1, 2):
            assert torch.equal(outs[rank][key], got), key
        communicator, gtopk, n = key
        if communicator == "sparse_allreduce" and not gtopk:
            torch.testing.assert_close(got, outs[0]["allgather", False, n])


EXACT_SIZES = [1, 2, 3, 37, 4096]


def exact_values(rank, n, dtype):
    """Values exact in every dtype below, whose average over ≤ 4 ranks is exact too."""
    gen = torch.Generator().manual_seed(7 * rank + n)
    return (torch.randint(-64, 64, (n,), generator=gen) * 0.25).to(dtype)


def dense_reduce_scatter_job(rank, world):
    out = {}
    for comp, dtype in [
        ("none", torch.float32),
        ("none", torch.float64),
        ("fp16", torch.float32),
        ("bf16", torch.float32),
    ]:
        grace = grace_dgc.build(comp, "residual", "reduce_scatter")
        for n in EXACT_SIZES:
            out[comp, dtype, n] = grace.step(exact_values(rank, n, dtype), f"{comp}{dtype}{n}")
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_of_dense_methods_is_the_exact_average(world):
    """Issue 20: with `none` the owner's error feedback zeroed the very payload it was about to
    send (the requantized chunk *is* the aggregate for `none`), so every rank got zeros."""
    outs = run_ranks(dense_reduce_scatter_job, world)
    for (comp, dtype, n), got in outs[0].items():
        exact = sum(exact_values(r, n, dtype) for r in range(world)) / world
        if comp == "none":
            torch.testing.assert_close(got, exact, rtol=0, atol=0, msg=f"{comp} {dtype} n={n}")
        else:  # each rank's x/N and the owner's average rounded to the wire dtype: |x| < 16, ε = 2^-11 or 2^-8
            eps = 2.0**-11 if comp == "fp16" else 2.0**-8
            torch.testing.assert_close(got, exact, rtol=0, atol=2 * 16 * eps, msg=f"{comp} {dtype} n={n}")
        for rank in range(1, world):
            assert torch.equal(outs[rank][comp, dtype, n], got), (comp, dtype, n)


def hierarchical_job(rank, world):
    out = {}
    for outer, comp, params in [
        ("allgather", "topk", {"compress_ratio": 0.3}),
        ("sparse_allreduce", "topk", {"compress_ratio": 0.3}),
        ("allreduce", "none", {}),
        ("reduce_scatter", "signsgd", {}),
    ]:
        grace = grace_dgc.build(comp, "none", "hierarchical", outer=outer, group_size=2, **params)
        out[outer] = grace.step_group_async(grads(rank), list("wbs")).result()
    return out


def test_hierarchical_on_two_emulated_nodes_of_two():
    world = 4
    outs = run_ranks(hierarchical_job, world)
    x = [grads(r) for r in range(world)]
    nodes = [[a + b for a, b in zip(x[0], x[1])], [a + b for a, b in zip(x[2], x[3])]]
    for outer in outs[0]:
        for rank in range(1, world):
            for a, b in zip(outs[rank][outer], outs[0][outer]):
                assert torch.equal(a, b), outer
    # reference: each node's sum compressed once, aggregated over the 2 nodes, / 4 ranks
    for t in range(3):
        dense = (nodes[0][t] + nodes[1][t]) / world
        torch.testing.assert_close(outs[0]["allreduce"][t], dense)
        topk = COMPRESSORS.get("topk")(compress_ratio=0.3)
        sparse = sum(topk.decompress(*topk.compress(node[t], "w")) for node in nodes) / world
        torch.testing.assert_close(outs[0]["allgather"][t], sparse)
        torch.testing.assert_close(outs[0]["sparse_allreduce"][t], sparse)
        vote = torch.sign(torch.sign(nodes[0][t]) + torch.sign(nodes[1][t]))  # ties (0 in 2 nodes) → 0
        signs = [torch.where(node[t] >= 0, 1.0, -1.0) for node in nodes]
        torch.testing.assert_close(outs[0]["reduce_scatter"][t], torch.sign(signs[0] + signs[1]))
        assert vote.shape == outs[0]["reduce_scatter"][t].shape


def bytes_job(rank, world, cases):
    out = {}
    for comp, comm, params, model in cases:
        grace = grace_dgc.build(comp, "none", comm, **params)
        g = torch.randn(1000, 1000, generator=torch.Generator().manual_seed(rank))
        payload = grace.wire.compress(g.clone(), "probe")[0]
        grace.reset_stats()
        grace.step(g, "g")
        stats = grace.stats()
        out[(comp, model)] = (
            sum(t.numel() * t.element_size() for t in payload),
            stats["bytes_sent"],
            stats["bytes_received"],
        )
    return out


CASES = [  # (compressor, communicator, parameters, the projection's name of it)
    ("topk", "allgather", {"compress_ratio": 0.01}, "allgather"),
    ("topk", "sparse_allreduce", {"compress_ratio": 0.01}, "sparse_allreduce"),
    ("topk", "sparse_allreduce", {"compress_ratio": 0.01, "global_topk": True}, "sparse_allreduce+global_topk"),
    ("qsgd", "allgather", {}, "allgather"),
    ("qsgd", "reduce_scatter", {}, "reduce_scatter"),
]


def auto_job(rank, world):
    out = {}
    for comp, params in [("topk", {"compress_ratio": 0.01}), ("qsgd", {}), ("none", {})]:
        grace = grace_dgc.build(comp, "none", "auto", interval=3, bandwidth=1e8, latency=1e-4, **params)
        results = []
        for step in range(8):
            g = torch.randn(200, 200, generator=torch.Generator().manual_seed(10 * rank + step))
            results.append(grace.step(g, "g"))
        out[comp] = (results, grace.stats()["auto"])
    return out


def test_auto_tries_each_fitting_communicator_then_all_ranks_agree():
    outs = run_ranks(auto_job, 2)
    for comp, expected in [
        ("topk", {"allgather", "sparse_allreduce"}),
        ("qsgd", {"allgather", "reduce_scatter"}),
        ("none", {"allreduce", "allgather", "reduce_scatter"}),
    ]:
        results, chosen = outs[0][comp]
        assert set(chosen["g"]["predicted_seconds"]) == expected
        assert chosen["g"]["choice"] in expected
        assert chosen["g"]["choice"] == outs[1][comp][1]["g"]["choice"]  # rank 0 decides for all
        for a, b in zip(results, outs[1][comp][0]):
            assert torch.equal(a, b)


def test_refusals_name_the_reason_and_what_fits():
    with pytest.raises(GraceConfigError, match="not sparse.*communicators that can"):
        grace_dgc.build("qsgd", "none", "sparse_allreduce", engine="local")
    with pytest.raises(GraceConfigError, match="chunk by chunk"):
        grace_dgc.build("topk", "none", "reduce_scatter", engine="local")
    with pytest.raises(GraceConfigError, match="several rounds"):
        grace_dgc.build("powersgd", "powersgd", "reduce_scatter", engine="local")
    with pytest.raises(GraceConfigError, match="several rounds"):  # whatever the outer (found under horovodrun)
        grace_dgc.build("powersgd", "powersgd", "hierarchical", outer="allgather", group_size=1, engine="local")
    with pytest.raises(GraceConfigError, match="outer communicator 'allreduce'"):
        grace_dgc.build("topk", "none", "hierarchical", outer="allreduce", engine="local")
    with pytest.raises(GraceConfigError, match="group_size"):
        grace_dgc.build("topk", "none", "hierarchical", group_size=0, engine="local")
    with pytest.raises(GraceConfigError, match="do not form nodes of group_size=2"):  # at bind, before collectives
        grace_dgc.build("topk", "none", "hierarchical", group_size=2, engine="local")
    assert COMMUNICATORS.get("sparse_allreduce").fits(COMPRESSORS.get("dgc")())


def test_single_process_engine_runs_every_new_communicator():
    x = torch.randn(50)
    for comm, comp, params in [
        ("sparse_allreduce", "topk", {"compress_ratio": 0.1}),
        ("reduce_scatter", "signsgd", {}),  # deterministic: the same signs chunk by chunk
        ("hierarchical", "none", {}),
        ("auto", "topk", {"bandwidth": 1e9, "latency": 1e-5}),
    ]:
        grace = grace_dgc.build(comp, "none", comm, engine="local", **params)
        plain = {k: v for k, v in params.items() if k not in ("bandwidth", "latency")}
        ref = grace_dgc.build(comp, "none", "allgather", engine="local", **plain)
        torch.testing.assert_close(grace.step(x, "x"), ref.step(x, "x"))
