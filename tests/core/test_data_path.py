"""The allocation-free data path: decompress_into / subtract_sent_ against the plain forms,
chunked passes against one pass, exact sampled top-k, random-k's sampler, in-place
exchanges, flat buckets and copies out of state_dict. Behaviour only; speed is measured by
benchmarks/bench_compressors.py and benchmarks/bench_overhead.py."""

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from method_params import PARAMS
from ranks import run_ranks

import grace_dgc
from grace_dgc import wire, workspace
from grace_dgc.compressors.topk import at_least, exact_top_k
from grace_dgc.registry import COMPRESSORS
from grace_dgc.workspace import Workspace, flat_span

SINGLE_ROUND = [n for n in grace_dgc.list_compressors() if COMPRESSORS.get(n).rounds == 1]


def make(name):
    return COMPRESSORS.get(name)(**PARAMS.get(name, {}))


def sample(numel, seed, dtype=torch.float32):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    if numel > 4:
        x[::4] = 0.0
    return x.reshape(-1, 1).to(dtype) if numel % 2 else x.to(dtype)


def same(a, b):
    """Equal values and dtype, NaN equal to NaN."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 elements: the chunked passes cross many chunk borders on small tensors."""
    monkeypatch.setattr(workspace, "CPU_CHUNK", 64)


# -- the allocation-free forms equal the plain ones -------------------------------------------


@pytest.mark.parametrize("name", grace_dgc.list_compressors())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decompress_into_and_subtract_sent_equal_the_plain_forms(name, dtype):
    comp = make(name)
    for numel in (1, 5, 300, 1001):
        x = sample(numel, numel, dtype)
        payload, ctx = comp.compress(x, f"w{numel}")
        while comp.rounds > 1:
            following = comp.next_round(payload, ctx)
            if following is None:
                break
            payload, ctx = following
        plain = comp.decompress(payload, ctx)
        out = torch.full_like(x, 7.0)  # stale values must be overwritten
        assert comp.decompress_into(payload, ctx, out) is out and same(out, plain.reshape(x.shape).to(dtype))
        residual = x.clone()
        assert comp.subtract_sent_(residual, payload, ctx) is residual
        assert same(residual, x - plain.reshape(x.shape).to(dtype))


@pytest.mark.parametrize("name", [n for n in SINGLE_ROUND if not COMPRESSORS.get(n).summable])
def test_decompress_aggregate_into_equals_decompress_aggregate(name):
    comp = make(name)
    ranks = [sample(301, seed) for seed in range(3)]
    payloads, ctxs = zip(*(comp.compress(x, "w") for x in ranks))
    expected = comp.decompress_aggregate(list(payloads), ctxs[0])
    out = torch.full_like(ranks[0], 7.0)
    assert same(comp.decompress_aggregate_into(list(payloads), ctxs[0], out), expected.reshape(out.shape))


@pytest.mark.parametrize("name", SINGLE_ROUND)
def test_chunked_passes_equal_one_pass(name, monkeypatch):
    """The same payload bits and output (the random streams too) whatever the chunk size."""
    x = sample(2003, 1)
    x.view(-1)[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 3e38, -1e-40])
    whole_comp, chunked_comp = make(name), make(name)
    whole_payload, ctx = whole_comp.compress(x, "w")
    whole = whole_comp.decompress(whole_payload, ctx)
    monkeypatch.setattr(workspace, "CPU_CHUNK", 64)
    payload, ctx = chunked_comp.compress(x, "w")
    assert all(same(a, b) for a, b in zip(payload, whole_payload))
    assert same(chunked_comp.decompress(payload, ctx), whole)


@pytest.fixture
def two_threads():
    """Two intra-op threads for one test (as on a 2-core machine), the count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_for_chunks_runs_chunks_on_one_thread_workers_in_order(monkeypatch, two_threads):
    """Chunks run on workers — the caller and the pool's threads — with one intra-op thread
    each (no fork-join per op), each in a lane of its own; results come back in chunk order,
    the caller's thread count is restored, an error in a chunk reaches the caller; with one
    thread (torchrun's default per rank) they run here, in lane 0."""
    monkeypatch.setattr(workspace, "CPU_CHUNK", 8)

    def where(start, stop):
        return start, stop, getattr(workspace._lane, "index", 0), torch.get_num_threads()

    spans = workspace.for_chunks(where, 50, "cpu")
    assert [(a, b) for a, b, _, _ in spans] == [(a, min(a + 8, 50)) for a in range(0, 50, 8)]
    assert all(lane != 0 and inner == 1 for _, _, lane, inner in spans)
    assert {lane for _, _, lane, _ in spans} <= {workspace.CALLER_LANE, 1}
    assert torch.get_num_threads() == 2 and not hasattr(workspace._lane, "index")

    def fails(start, stop):
        if start == 16:
            raise ValueError("chunk 16")
        return start

    with pytest.raises(ValueError, match="chunk 16"):
        workspace.for_chunks(fails, 50, "cpu")
    torch.set_num_threads(1)
    assert {lane for _, _, lane, _ in workspace.for_chunks(where, 50, "cpu")} == {0}


def test_chunk_workers_have_their_own_scratch(monkeypatch, two_threads):
    monkeypatch.setattr(workspace, "CPU_CHUNK", 8)
    ws = Workspace()
    buffers = workspace.for_chunks(lambda a, b: ws.get("s", b - a, torch.float32, "cpu").data_ptr(), 4000, "cpu")
    lanes = {getattr(workspace._lane, "index", 0)}
    assert ws.get("s", 8, torch.float32, "cpu").data_ptr() not in buffers and lanes == {0}
    assert len(set(buffers)) == len({k[3] for k in ws._buffers}) - 1  # one buffer per worker that ran


def test_compress_never_writes_its_input():
    for name in grace_dgc.list_compressors():
        for dtype in (torch.float32, torch.float16):
            x = sample(501, 3, dtype)
            before = x.clone()
            make(name).compress(x, "w")
            assert torch.equal(x, before), name


def test_workspace_reuses_buffers_and_copies_start_empty():
    ws = Workspace()
    a = ws.get("s", 10, torch.float32, "cpu")
    b = ws.get("s", 6, torch.float32, "cpu")
    assert b.data_ptr() == a.data_ptr() and b.numel() == 6 and ws.nbytes() == 40
    ws.get("s", 20, torch.float32, "cpu")  # grows
    assert ws.nbytes() == 80
    assert copy.deepcopy(ws).nbytes() == 0


# -- bit packing --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.integers(0, 700), st.integers(0, 2**32 - 1), st.integers(0, 5))
def test_pack_chunks_match_the_reference_stream_at_any_offset(bits, n, seed, offset):
    """Every chunk border and any misaligned packed buffer (a received payload slice)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**bits, n).astype(np.uint8)
    reference = np.packbits(((codes[:, None] >> np.arange(bits)) & 1).reshape(-1), bitorder="little")
    old = workspace.CPU_CHUNK
    try:
        workspace.CPU_CHUNK = 64
        packed = wire.pack_bits(torch.from_numpy(codes), bits, Workspace())
        assert packed.tolist() == reference.tolist()
        shifted = torch.cat([torch.zeros(offset, dtype=torch.uint8), packed])[offset:]
        assert wire.unpack_bits(shifted, bits, n, Workspace()).tolist() == codes.tolist()
    finally:
        workspace.CPU_CHUNK = old


def test_unpack_select_writes_exactly_one_of_the_two_values(small_chunks):
    bits = torch.randint(0, 2, (1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = wire.pack_bits(bits, 1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = torch.empty(1000, dtype=dtype)
        wire.unpack_select(packed, out, 0.375, -2.5, Workspace())
        assert torch.equal(out, torch.where(bits.bool(), 0.375, -2.5).to(dtype))


# -- exact top-k and the threshold scan ------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 3000), st.floats(0.0005, 1.0), st.integers(0, 2**31), st.integers(1, 50))
def test_exact_top_k_is_torch_topk_with_ties_to_the_lowest_indices(n, ratio, seed, levels):
    """Heavy ties (values from a few levels): the k largest magnitudes exactly, ascending
    indices, and of the elements tied at the k-th magnitude the lowest indices."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randint(-levels, levels + 1, (n,), generator=gen) / levels).float()
    k = max(1, int(n * ratio))
    old = workspace.CPU_CHUNK
    try:
        workspace.CPU_CHUNK = 256
        chosen = exact_top_k(x, k, Workspace())
    finally:
        workspace.CPU_CHUNK = old
    assert chosen.numel() == k and bool((chosen[1:] > chosen[:-1]).all())
    magnitude = x.abs()
    kth = torch.topk(magnitude, k).values.min()
    assert torch.equal(magnitude[chosen].sort().values, torch.topk(magnitude, k).values.sort().values)
    larger = torch.nonzero(magnitude > kth).view(-1)
    tied = torch.nonzero(magnitude == kth).view(-1)[: k - larger.numel()]
    assert torch.equal(chosen, torch.cat([larger, tied]).sort().values)


def test_exact_top_k_on_a_large_tensor_matches_torch_topk():
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(5))
    x[[7, 99, 12345]] = float("nan")  # torch.topk ranks NaN highest; so does this
    for k in (1, 40, 4000, 40_000):
        chosen = exact_top_k(x, k, Workspace())
        assert set(chosen.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


@pytest.mark.parametrize("keep_nan", [True, False])
def test_at_least_is_the_magnitude_comparison_with_nan_as_asked(keep_nan, small_chunks):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    x[:8] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1.5, -1.5])
    for threshold in (0.0, 1e-40, 1.5, 3.0, float("inf")):
        indices, magnitudes = at_least(x, threshold, Workspace(), keep_nan)
        expected = torch.nonzero(~(x.abs() < threshold) if keep_nan else x.abs() >= threshold).view(-1)
        assert torch.equal(indices, expected) and same(magnitudes, x.abs()[expected])
        half = at_least(x.half(), threshold, Workspace(), keep_nan)[0]  # the comparison path
        assert torch.equal(
            half, torch.nonzero(~(x.half().abs() < threshold) if keep_nan else x.half().abs() >= threshold).view(-1)
        )


# -- the exchange: in place, flat buckets --------------------------------------------------


def test_flat_span_finds_back_to_back_views_only():
    flat = torch.arange(10.0)
    a, b, c = flat[:3], flat[3:7].view(2, 2), flat[7:]
    span = flat_span([a, b, c])
    assert span.data_ptr() == flat.data_ptr() and span.numel() == 10
    assert flat_span([a, c]) is None and flat_span([b, a]) is None
    assert flat_span([a, torch.zeros(3)]) is None and flat_span([flat[::2]]) is None
    assert flat_span([a, flat[3:5].view(torch.int32)]) is None  # back to back, another dtype
    assert flat_span([a, flat[3:9:2]]) is None  # starts where a ends, strided
    # back to back in memory but two storages (numpy's halves): no span past the first storage
    halves = np.zeros(8, dtype=np.float32)
    first, second = torch.from_numpy(halves[:4]), torch.from_numpy(halves[4:])
    assert second.data_ptr() == first.data_ptr() + 16 and flat_span([first, second]) is None


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "randomk", "topk", "qsgd"])
@pytest.mark.parametrize("memory", ["none", "residual"])
def test_inplace_exchange_writes_the_inputs_and_equals_a_copying_one(name, memory):
    comm = "allreduce" if COMPRESSORS.get(name).summable else "allgather"
    flat = torch.randn(300, generator=torch.Generator().manual_seed(1))
    views = [flat[:100], flat[100:160].view(6, 10), flat[160:]]
    copying = grace_dgc.build(name, memory, comm, engine="local", **PARAMS.get(name, {}))
    inplace = grace_dgc.build(name, memory, comm, engine="local", **PARAMS.get(name, {}))
    names = ["a", "b", "c"]
    for _ in range(3):
        inputs = [v.clone() for v in views]
        expected = copying.step_group_async(inputs, names).result()
        assert all(torch.equal(i, v) for i, v in zip(inputs, views))  # inputs untouched
        handed = [t.clone() for t in views]
        bucket = torch.cat([t.reshape(-1) for t in handed])
        handed = [bucket[:100], bucket[100:160].view(6, 10), bucket[160:]]
        got = inplace.step_group_async(handed, names, inplace=True).result()
        assert all(g is h for g, h in zip(got, handed))
        assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_a_single_tensor_step_never_changes_its_input():
    for name in ("none", "fp16", "randomk"):
        grace = grace_dgc.build(name, engine="local")
        x = torch.randn(64)
        before = x.clone()
        grace.step(x, "w")
        assert torch.equal(x, before), name


def test_state_dict_hands_out_copies():
    grace = grace_dgc.build("topk", "residual", "allgather", engine="local", compress_ratio=0.25)
    signum = grace_dgc.build("signum", "none", "allgather", engine="local")
    for g in (grace, signum):
        g.step(torch.randn(40), "w")
    saved = copy.deepcopy(grace.state_dict()), copy.deepcopy(signum.state_dict())
    live = grace.state_dict(), signum.state_dict()
    for g in (grace, signum):
        g.step(torch.randn(40), "w")
    assert torch.equal(live[0]["memory"]["residuals"]["w"], saved[0]["memory"]["residuals"]["w"])
    assert torch.equal(live[1]["compressor"]["momentums"]["w"], saved[1]["compressor"]["momentums"]["w"])
    # loading twice from one checkpoint resumes identically both times
    results = []
    for _ in range(2):
        fresh = grace_dgc.build("topk", "residual", "allgather", engine="local", compress_ratio=0.25)
        fresh.load_state_dict(live[0])
        results.append(fresh.step(torch.ones(40), "w"))
    assert torch.equal(*results)


def optimizer_views_job(rank, world_size, fusion_bytes=4 * 2**20):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        grace_dgc.build("none", "none", "allreduce"),
        model.named_parameters(),
        fusion_bytes=fusion_bytes,
    )
    out = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        # this rank's own gradient, from a copy: p.grad is exchanged in place once backward
        # has produced it, so it is only defined again after synchronize()
        reference = copy.deepcopy(model)
        local = torch.autograd.grad(reference(x).square().sum(), list(reference.parameters()))
        opt.zero_grad(set_to_none=step != 1)
        model(x).square().sum().backward()
        opt.synchronize()
        grads = [p.grad for p in model.parameters()]
        # reverse registration order, back to back: one bucket, or (100 bytes) three of them and w1 alone
        spans = flat_span(grads[::-1] if fusion_bytes > 100 else grads[:0:-1])
        out.append({"local": local, "averaged": [g.clone() for g in grads], "one_buffer": spans is not None})
        opt.step()
    return out


@pytest.mark.parametrize("fusion_bytes", [4 * 2**20, 100])
def test_optimizer_gradients_live_in_one_flat_buffer_and_are_averaged(fusion_bytes):
    """One bucket (the last one, exchanged inline), and two (the first on the communication
    thread): set_to_none=True and False alike, every gradient in its bucket's buffer."""
    per_rank = run_ranks(optimizer_views_job, 2, args=(fusion_bytes,))
    for step in range(3):
        for rank in range(2):
            assert per_rank[rank][step]["one_buffer"]
            for i, averaged in enumerate(per_rank[rank][step]["averaged"]):
                expected = (per_rank[0][step]["local"][i] + per_rank[1][step]["local"][i]) / 2
                assert torch.equal(averaged, expected)


def last_group_job(rank, world_size):
    """Groups handed to the communication thread, then one with overlap=False: it runs on the
    caller's thread, after them (a slow first group must be done before it starts)."""
    import threading
    import time

    grace = grace_dgc.build("none", "none", "allreduce")
    events = []

    def slow():
        time.sleep(0.3)
        events.append(("slow", threading.current_thread().name))

    grace.run_in_order(slow)
    first = grace.step_group_async([torch.full((3,), float(rank))], ["a"])
    last = grace.run_in_order(lambda: events.append(("last", threading.current_thread().name)), overlap=False)
    assert last.done()  # ran here, now
    caller = threading.current_thread().name
    return events, caller, first.result()[0].tolist()


def test_the_last_group_runs_on_the_callers_thread_after_the_ones_before_it():
    for events, caller, average in run_ranks(last_group_job, 2):
        assert [what for what, _ in events] == ["slow", "last"]
        assert events[0][1].startswith("grace-comm") and events[1][1] == caller
        assert average == [0.5] * 3


@pytest.mark.parametrize("name", ["none", "topk", "fp16"])
def test_inplace_exchange_of_a_non_contiguous_tensor(name):
    comm = "allreduce" if COMPRESSORS.get(name).summable else "allgather"
    grace = grace_dgc.build(name, "none", comm, engine="local", **PARAMS.get(name, {}))
    reference = grace_dgc.build(name, "none", comm, engine="local", **PARAMS.get(name, {}))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3)).t()  # a transposed view
    expected = reference.step(x.clone(), "w")
    got = grace.step_group_async([x], ["w"], inplace=True).result()[0]
    assert got is x and torch.equal(x, expected)


def test_the_optional_hooks_are_declared_on_the_interfaces():
    """A plugin defining only compress/decompress gets no-op bind, set_epoch, stats (and a
    memory no-op attach_optimizer), so Grace calls them without probing."""

    class Plain(grace_dgc.Compressor):
        summable = True

        def compress(self, tensor, name):
            return [tensor * 2], None

        def decompress(self, payload, ctx):
            return payload[0] / 2

    class Forgetful(grace_dgc.Memory):
        pass

    engine = grace_dgc.create_engine("local")
    allreduce = grace_dgc.registry.COMMUNICATORS.get("allreduce")(engine)
    grace = grace_dgc.Grace(Plain(), Forgetful(), allreduce, engine)
    grace.set_epoch(3)
    assert torch.equal(grace.step(torch.ones(3), "w"), torch.ones(3))
    assert grace.stats()["steps"] == 1
    model = torch.nn.Linear(2, 2)
    grace_dgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grace, model.named_parameters())


def test_a_stochastic_compressor_draws_from_its_engines_rank():
    class Rank1:
        rank, size, name = 1, 2, "fake"

    seeded = COMPRESSORS.get("qsgd")(seed=5)
    bound = COMPRESSORS.get("qsgd")(seed=4)
    bound.bind(Rank1())
    x = torch.randn(300, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(seeded.compress(x, "w")[0], bound.compress(x, "w")[0]))


IN_PLACE_CASES = [
    ("topk", "residual", "allgather"),
    ("topk", "residual", "broadcast"),
    ("topk", "residual", "sparse_allreduce"),
    ("topk", "residual", "auto"),
    ("qsgd", "residual", "reduce_scatter"),
    ("qsgd", "residual", "hierarchical"),
    ("efsignsgd", "efsignsgd", "allgather"),
    ("efsignsgd", "efsignsgd", "reduce_scatter"),
    ("dgc", "momentum", "sparse_allreduce"),
    ("powersgd", "powersgd", "allreduce"),
]


@pytest.mark.parametrize("name, memory, comm", IN_PLACE_CASES)
def test_handing_the_gradients_over_loses_no_memory_state(name, memory, comm):
    """With ``inplace=True`` the average is written into the gradients, which the memory's
    ``compensate`` may have returned (the residual memory's first step): its ``update``
    must still see the compensated gradient, on every communicator (a bug of the
    aggregating communicators until the single data path: their residual came out 0)."""
    params = dict(PARAMS.get(name, {}), **({"group_size": 1} if comm == "hierarchical" else {}))
    copying = grace_dgc.build(name, memory, comm, engine="local", **params)
    inplace = grace_dgc.build(name, memory, comm, engine="local", **params)
    gen = torch.Generator().manual_seed(3)
    names = ["w", "b"]
    for _ in range(3):
        grads = [torch.randn(8, 6, generator=gen), torch.randn(5, generator=gen)]
        expected = copying.step_group_async([g.clone() for g in grads], names).result()
        handed = [g.clone() for g in grads]
        got = inplace.step_group_async(handed, names, inplace=True).result()
        assert all(torch.equal(g, e) for g, e in zip(got, expected))
        state, reference = inplace.memory.state_dict(), copying.memory.state_dict()
        for key in reference:
            for tensor_name, kept in reference[key].items() if isinstance(reference[key], dict) else []:
                assert torch.equal(state[key][tensor_name], kept), (key, tensor_name)
    if memory in ("residual", "efsignsgd") and name != "powersgd":  # something was held back
        assert any(r.abs().sum() > 0 for r in inplace.memory.residuals.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    bad=st.sampled_from([None, float("nan"), float("inf"), float("-inf")]),
    big=st.booleans(),
    data=st.data(),
)
@settings(max_examples=40, deadline=None)
def test_all_finite_equals_an_element_by_element_check(dtype, sizes, bad, big, data):
    """One total per group, read once; finite elements whose sums overflow (the dtype's
    largest values, several tensors) are still finite; a NaN/Inf anywhere is found."""
    from grace_dgc.workspace import all_finite

    top = torch.finfo(dtype).max
    tensors = [
        torch.full((n,), top, dtype=dtype) if big else torch.randn(n, dtype=torch.float64).to(dtype) for n in sizes
    ]
    if bad is not None and sum(sizes):
        which = data.draw(st.sampled_from([i for i, n in enumerate(sizes) if n]))
        tensors[which][data.draw(st.integers(0, sizes[which] - 1))] = bad
    expected = all(bool(torch.isfinite(t).all()) for t in tensors)
    assert all_finite(tensors) is expected


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([np.float32, np.float64]),
    st.sampled_from(["ge", "le", "lt"]),
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=64),
    st.floats(allow_nan=False, allow_infinity=True, width=64),
)
def test_compare_into_a_mask_is_the_comparison_in_the_tensors_dtype(dtype, op, values, value):
    """workspace.compare (numpy's loop on a CPU) against Python's comparison of each element with
    the value rounded to the tensor's dtype, as torch compares: NaN false, −0 equal to +0."""
    x = torch.from_numpy(np.array(values, dtype=dtype))
    with np.errstate(over="ignore"):  # beyond fp32's range: ±inf, as torch rounds it
        rounded = float(dtype(value))
    check = {"ge": lambda a: a >= rounded, "le": lambda a: a <= rounded, "lt": lambda a: a < rounded}[op]
    out = torch.empty(len(values), dtype=torch.bool)
    assert workspace.compare(op, x, value, out) is out
    assert out.tolist() == [check(float(a)) for a in x.tolist()]
    assert torch.equal(out, getattr(torch, op)(x, value))
