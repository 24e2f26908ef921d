"""The CUDA path (issue 22): the same assertions on ``cpu`` and, where torch sees a GPU,
``cuda`` (the ``device`` fixture); the checks only a GPU can make (NCCL, streams, the DDP hook
on a CUDA bucket, CUDA random streams across ranks, ``max_memory_allocated``) skip on a CPU
machine with the reason. ``make gpu-check`` runs this file on a GPU and writes the report.

One GPU holds several ranks only over gloo (NCCL refuses two ranks on one device), so the
multi-rank cases run gloo over CUDA tensors, and NCCL runs with one rank per GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from method_params import PARAMS
from test_state import resume_job

import grace_dgc
from grace_dgc.launch import run_local
from grace_dgc.registry import COMPRESSORS

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run `make gpu-check` on a machine with one")
GPUS = torch.cuda.device_count() if CUDA else 0

# the methods whose output is a function of the input alone (no random stream): CUDA and CPU
# must agree on them up to float rounding of the reductions
DETERMINISTIC = ["none", "fp16", "bf16", "topk", "threshold", "signsgd", "signum", "onebit", "twobit", "efsignsgd"]
# memory and communicator each method is built with in the multi-rank cases
SETUPS = {
    "dgc": ("momentum", "allgather"),
    "powersgd": ("powersgd", "allreduce"),
    "efsignsgd": ("efsignsgd", "allgather"),
    "signum": ("none", "allgather"),
}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=needs_cuda)])
def device(request):
    return torch.device(request.param)


def make(name):
    return COMPRESSORS.get(name)(**PARAMS.get(name, {}))


def round_trip(comp, x, name="w", with_ctx=False):
    """decompress(compress(x)) after every round, written into a stale tensor like the data path:
    (payload, decoded), and the last round's ctx with ``with_ctx``."""
    payload, ctx = comp.compress(x, name)
    while comp.rounds > 1:
        following = comp.next_round(payload, ctx)
        if following is None:
            break
        payload, ctx = following
    out = torch.full_like(x, 7.0)
    comp.decompress_into(payload, ctx, out)
    return (payload, out, ctx) if with_ctx else (payload, out)


def sample(numel, seed, device):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    x[::5] = 0.0
    return x.reshape(-1, 10).to(device)


# -- the same assertions on every device ---------------------------------------------------


@pytest.mark.parametrize("name", grace_dgc.list_compressors())
def test_every_compressor_keeps_the_device_and_dtype(device, name):
    x = sample(4000, 1, device)
    payload, out = round_trip(make(name), x)
    assert all(t.device.type == device.type for t in payload), f"{name}: a payload tensor left {device}"
    assert out.device.type == device.type and out.dtype == x.dtype and torch.isfinite(out).all()


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_deterministic_methods_agree_with_the_cpu(device, name):
    x = sample(4000, 2, "cpu")
    _, expected = round_trip(make(name), x)
    _, got = round_trip(make(name), x.to(device))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-6)


def step_job(rank, world_size, device, names):
    """Three steps of each method on ``device`` over the process group; returns the outputs."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    results = {}
    for name in names:
        memory, communicator = SETUPS.get(name, ("residual", "allgather"))
        grace = grace_dgc.build(name, memory, communicator, **PARAMS.get(name, {}))
        gen = torch.Generator().manual_seed(rank)
        outs = []
        for _ in range(3):
            grads = [torch.randn(40, 10, generator=gen).to(dev), torch.randn(7, 5, generator=gen).to(dev)]
            outs.append([t.cpu() for t in grace.step_group_async(grads, ["a", "b"]).result()])
        results[name] = outs
    return results


@pytest.mark.launches
def test_two_ranks_agree_on_every_method_and_the_cpu_run(device):
    """Two gloo ranks on ``device``: both hold the same average at every step, and for the
    deterministic methods it equals the CPU run's."""
    names = grace_dgc.list_compressors()
    on_device = run_local(step_job, 2, (device.type, names), timeout=600)
    on_cpu = run_local(step_job, 2, ("cpu", DETERMINISTIC), timeout=600) if device.type == "cuda" else on_device
    for name in names:
        for step, (a, b) in enumerate(zip(on_device[0][name], on_device[1][name])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{name}: ranks differ at step {step}"
    for name in DETERMINISTIC:
        for step, (got, want) in enumerate(zip(on_device[0][name], on_cpu[0][name])):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{name} step {step}")


# -- only a GPU can check these -------------------------------------------------------------


@needs_cuda
@pytest.mark.launches
def test_resume_is_bit_exact_on_nccl():
    """The issue-26 resume matrix (14 methods over every communicator) on NCCL, one rank per GPU."""
    for rank, mismatches in enumerate(run_local(resume_job, GPUS, ("cuda",), backend="nccl", timeout=600)):
        assert not mismatches, f"rank {rank}: {mismatches}"


@needs_cuda
@pytest.mark.launches
def test_resume_is_bit_exact_over_gloo_on_cuda_tensors():
    for rank, mismatches in enumerate(run_local(resume_job, 2, ("cuda",), timeout=600)):
        assert not mismatches, f"rank {rank}: {mismatches}"


def train_job(rank, world_size, mode, side_stream):
    """Five SGD steps of a small CUDA model: plain (``mode == "plain"``, the reference), through
    DistributedOptimizer (``optimizer``) or DDP with grace's hook (``hook``), the forward and
    backward on a side stream when ``side_stream``. Returns the final parameters on the CPU."""
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
    net = model
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if mode == "optimizer":
        sgd = grace_dgc.DistributedOptimizer(
            sgd, grace_dgc.build("none", "none", "allreduce"), model.named_parameters()
        )
    elif mode == "hook":
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
        net.register_comm_hook(*grace_dgc.ddp_comm_hook(grace_dgc.build("none", "none", "allreduce"), net))
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    gen = torch.Generator().manual_seed(7)  # the same batches on every rank: the average is the batch's gradient
    for _ in range(5):
        x, y = torch.randn(32, 64, generator=gen).to(dev), torch.randint(0, 10, (32,), generator=gen).to(dev)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            sgd.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            sgd.step()
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return [p.detach().cpu() for p in model.parameters()]


@needs_cuda
@pytest.mark.launches
@pytest.mark.parametrize("mode", ["optimizer", "hook"])
@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_dense_training_on_nccl_equals_plain_sgd(mode, side_stream):
    """none + allreduce on NCCL (the communication thread's stream waits on the gradients'
    event; the hook writes the bucket back) trains exactly as plain SGD on the same batches."""
    plain = run_local(train_job, 1, ("plain", side_stream), backend="nccl", timeout=300)[0]
    for rank, params in enumerate(run_local(train_job, GPUS, (mode, side_stream), backend="nccl", timeout=300)):
        for got, want in zip(params, plain):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")


def rng_job(rank, world_size, names):
    torch.cuda.set_device(0)
    out = {}
    for name in names:
        grace = grace_dgc.build(name, "residual", "allgather", **PARAMS.get(name, {}))
        grads = [torch.randn(300, 10, generator=torch.Generator().manual_seed(rank)).cuda()]
        out[name] = [grace.step_group_async(grads, ["w"]).result()[0].cpu() for _ in range(2)]
    return out


@needs_cuda
@pytest.mark.launches
def test_cuda_random_streams_are_reproducible_across_runs_and_ranks():
    """qsgd, terngrad, natural and randomk draw from CUDA generators: two runs with the same
    seeds give the same bits, and the ranks hold the same average."""
    names = ["qsgd", "terngrad", "natural", "randomk"]
    first = run_local(rng_job, 2, (names,), timeout=300)
    again = run_local(rng_job, 2, (names,), timeout=300)
    for name in names:
        assert all(torch.equal(a, b) for a, b in zip(first[0][name], first[1][name])), f"{name}: ranks differ"
        assert all(torch.equal(a, b) for a, b in zip(first[0][name], again[0][name])), f"{name}: not reproducible"


@needs_cuda
@pytest.mark.parametrize("name", ["none", "topk", "qsgd"])
def test_a_step_allocates_little_beyond_the_gradient(name):
    """Peak CUDA memory of a one-rank step over a 4M-element gradient: at most three gradients'
    worth (payload, what comes back, the memory's residual or the output) — not a copy per
    stage. Measured on an H100, torch 2.11: none 2.15, qsgd 2.71."""
    from grace_dgc.engines import create_engine

    grace = grace_dgc.build(name, "residual" if name != "none" else "none", "allgather", engine=create_engine("local"))
    grad = torch.randn(2000, 2000, device="cuda")
    grace.step_group_async([grad.clone()], ["w"]).result()  # workspaces and state exist after the first step
    second = grad.clone()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grace.step_group_async([second], ["w"]).result()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - before) / grad.nbytes
    assert extra <= 3.0, f"{name}: a step allocated {extra:.2f}x the gradient"


def checkpoint_job(rank, world_size):
    """Rank-0 checkpoints on the engine's device: gather every rank's state on rank 0, load it
    into fresh objects (only rank 0 holds it); returns whether the states equal."""
    from test_state import same

    torch.cuda.set_device(rank % torch.cuda.device_count())
    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        grace.step_group_async([torch.randn(50, 4, generator=gen).cuda()], ["w"]).result()
    gathered = grace_dgc.gather_state(grace)
    fresh = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.2)
    grace_dgc.load_gathered_state(fresh, gathered if rank == 0 else None)
    return same(grace.state_dict(), fresh.state_dict())


@needs_cuda
@pytest.mark.launches
def test_rank0_checkpoint_on_nccl():
    assert all(run_local(checkpoint_job, GPUS, (), backend="nccl", timeout=300))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 1.0, -2.0, 3.5, float("nan"), 7.0, 1e-30]), min_size=1, max_size=80),
    st.data(),
)
def test_the_kth_smallest_by_topk_is_kthvalue(values, data):
    """kth_smallest's CUDA form (the largest of the j smallest) picks kthvalue's element,
    ties and NaNs (the largest) included: checked on the CPU, where both run."""
    v = torch.tensor(values)
    j = data.draw(st.integers(1, len(values)))
    by_topk = torch.topk(v, j, largest=False, sorted=False).values.max()
    assert same_value(by_topk, torch.kthvalue(v, j).values)


def same_value(a, b):
    return bool(torch.isnan(a) & torch.isnan(b)) or bool(a == b)


def test_exact_top_k_on_the_device_is_torch_topk(device):
    """The sampled path (n > 65536) on ``device``: the set torch.topk selects, ties at the
    k-th magnitude to the lowest indices."""
    from grace_dgc.compressors.topk import exact_top_k, kth_smallest
    from grace_dgc.workspace import Workspace

    gen = torch.Generator().manual_seed(3)
    flat = torch.randn(300_000, generator=gen).round(decimals=2)  # many ties
    k = 3_000
    got = exact_top_k(flat.to(device), k, Workspace()).cpu()
    magnitude = flat.abs()
    kth = torch.topk(magnitude, k).values[-1]
    above = torch.nonzero(magnitude > kth).view(-1)
    tied = torch.nonzero(magnitude == kth).view(-1)[: k - above.numel()]
    assert torch.equal(got, torch.cat([above, tied]).sort().values)
    v = magnitude[:5000].to(device)
    assert same_value(kth_smallest(v, 77).cpu(), torch.kthvalue(magnitude[:5000], 77).values)


@pytest.mark.parametrize("bits", [1, 2, 8])
def test_statq_whole_tensor_path_bins_each_value_once_and_repeats_bit_for_bit(device, bits):
    """statq's GPU path (the whole tensor at once; run on the CPU here too): each bin's entry is
    the float64 mean of what its codes hold, rounded once, and two runs give the same payload
    bit for bit (its float64 row sums: the atomics' order cannot show in the fp32 means)."""
    n = 3 * 4096 + 17  # rows of BIN_ROW and a partial last row
    x = (torch.randn(n, generator=torch.Generator().manual_seed(bits)) * 3 + 1).to(device)
    comp = COMPRESSORS.get("statq")(bits=bits)
    first, second = comp._compress_elementwise(x), comp._compress_elementwise(x)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    codes = grace_dgc.wire.unpack_bits(first[0], bits, n).long().cpu()
    centered = (x - x.mean()).double().cpu()
    counts = torch.bincount(codes, minlength=2**bits)
    means = torch.bincount(codes, weights=centered, minlength=2**bits) / counts.clamp(min=1)
    assert torch.equal(first[1][1:].cpu(), torch.where(counts > 0, means, 0.0).float())


@needs_cuda
@pytest.mark.parametrize("name", grace_dgc.list_compressors())
def test_no_compressor_synchronizes_with_the_host(name):
    """Issue 58, item 2: compress, every further round and decompress of a warmed-up compressor
    under ``torch.cuda.set_sync_debug_mode("error")``: an ``.item()``, a ``nonzero()`` without a
    size or a copy to the host raises, naming the op."""
    x = sample(1 << 16, 3, torch.device("cuda"))
    comp = make(name)
    round_trip(comp, x)  # the first call may allocate and compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        round_trip(comp, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
