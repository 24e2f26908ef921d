"""DGC (sampled threshold, warm-up, dense rule) and the momentum-corrected memory."""

import copy
import logging
import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ranks import run_ranks

import grace_dgc
from grace_dgc.compressors.dgc import DGCCompressor
from grace_dgc.compressors.topk import sparse_payload
from grace_dgc.errors import GraceConfigError
from grace_dgc.memories.momentum import MomentumMemory


def bounds(n, ratio):
    k = max(1, int(n * ratio))
    return k, (13 * k) // 10


def check_selection(comp, tensor, ratio):
    """Sent count within [k, ⌊1.3k⌋], distinct in-range indices, and no unsent element
    larger in magnitude than a sent one (every branch of the rule keeps that order)."""
    payload, ctx = comp.compress(tensor, "t")
    values, indices = payload
    flat = tensor.reshape(-1)
    k, high = bounds(flat.numel(), ratio)
    idx = indices.long()
    assert indices.dtype == torch.int32
    assert k <= idx.numel() <= high, (idx.numel(), k, high)
    assert idx.unique().numel() == idx.numel() and int(idx.min()) >= 0 and int(idx.max()) < flat.numel()
    assert torch.equal(values, flat[idx])
    unsent = torch.ones(flat.numel(), dtype=torch.bool)
    unsent[idx] = False
    if unsent.any():
        assert flat[idx].abs().min() >= flat[unsent].abs().max()
    assert torch.equal(comp.decompress(payload, ctx).reshape(-1)[idx], flat[idx])
    assert torch.equal(comp.sent_mask(payload, ctx).reshape(-1), ~unsent)
    return idx.numel()


KINDS = ["normal", "equal", "zeros", "one_huge", "few_huge", "ties", "heavy"]


def make(kind, n, gen):
    if kind == "normal":
        return torch.randn(n, generator=gen)
    if kind == "equal":
        return torch.full((n,), -0.5)
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "one_huge":
        t = torch.randn(n, generator=gen) * 1e-3
        t[torch.randint(n, (1,), generator=gen)] = 1e30
        return t
    if kind == "few_huge":
        t = torch.zeros(n)
        t[torch.randperm(n, generator=gen)[: max(1, n // 5000)]] = 7.0
        return t
    if kind == "ties":
        return torch.randint(-3, 4, (n,), generator=gen).float()
    return torch.randn(n, generator=gen) ** 5  # heavy tails


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 60),
    cols=st.integers(1, 90),
    ratio=st.floats(1e-3, 1.0),
    sample_ratio=st.sampled_from([0.001, 0.01, 0.2, 1.0]),
    kind=st.sampled_from(KINDS),
    decay=st.sampled_from([0.5, 0.8, 0.999]),
    iters=st.integers(0, 3),
    seed=st.integers(0, 2**20),
)
def test_selection_bounds_hypothesis(rows, cols, ratio, sample_ratio, kind, decay, iters, seed):
    comp = DGCCompressor(
        compress_ratio=ratio,
        sample_ratio=sample_ratio,
        min_compress_size=0,
        max_adaptation_iters=iters,
        threshold_decay=decay,
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed)
    check_selection(comp, make(kind, rows * cols, gen).reshape(rows, cols), ratio)


@pytest.mark.parametrize("kind", KINDS)
def test_selection_bounds_large_sampled(kind):
    # 100k elements at 0.001: the strided-sample path (stride 51), with the exact
    # fallback forced (decay≈1, no retries) and the default retries
    n, ratio = 100_000, 0.001
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        tensor = make(kind, n, gen).reshape(200, 500)
        for iters, decay in ((10, 0.8), (0, 0.999)):
            comp = DGCCompressor(compress_ratio=ratio, max_adaptation_iters=iters, threshold_decay=decay, seed=seed)
            check_selection(comp, tensor, ratio)


def test_selection_branches_reached(monkeypatch):
    """The sample is much smaller than the tensor, and re-selection happens when too many pass."""
    sizes = []
    real_topk = torch.topk

    def spy(x, k, *args, **kwargs):
        sizes.append((x.numel(), k))
        return real_topk(x, k, *args, **kwargs)

    monkeypatch.setattr(torch, "topk", spy)
    comp = DGCCompressor(compress_ratio=0.001, seed=3)
    comp.compress(torch.full((400, 500), 2.0), "t")  # all equal: all pass, top-k of candidates
    (sample_n, _), (cand_n, cand_k) = sizes
    assert sample_n < 2500 and cand_n == 200_000 and cand_k == 200
    sizes.clear()
    comp.compress(torch.randn(400, 500, generator=torch.Generator().manual_seed(0)), "t")
    assert sizes[0][0] < 2500 and all(n < 200_000 for n, _ in sizes)  # never a full top-k


def test_warmup_paper_numbers_and_default_schedule():
    paper = [0.75, 0.9375, 0.984375, 0.99609375, 0.999]  # printed as 99.6% in the paper
    comp = DGCCompressor(compress_ratio=0.001, warmup_epochs=5, warmup_coeff=0.25)
    for epoch, sparsity in enumerate(paper + [0.999, 0.999]):
        comp.set_epoch(epoch)
        assert 1 - comp.stats()["dgc_compress_ratio"] == pytest.approx(sparsity, abs=1e-12)
    comp = DGCCompressor(compress_ratio=0.001, warmup_epochs=5)  # 0.001^((e+1)/5)
    expected = [10 ** (-0.6 * (e + 1)) for e in range(5)] + [0.001]
    got = [comp.ratio_at(e) for e in range(6)]
    assert got == pytest.approx(expected, rel=1e-9)
    assert [round(100 * (1 - r), 1) for r in got[:5]] == [74.9, 93.7, 98.4, 99.6, 99.9]
    comp = DGCCompressor(compress_ratio=0.01, warmup_ratios=[0.5, 0.2])
    assert [comp.ratio_at(e) for e in range(4)] == [0.5, 0.2, 0.01, 0.01]


def test_warmup_drives_what_is_sent_through_grace():
    grace = grace_dgc.build(
        "dgc", "none", "allgather", engine="local", compress_ratio=0.001, warmup_epochs=5, warmup_coeff=0.25
    )
    tensor = torch.randn(100, 200, generator=torch.Generator().manual_seed(1))
    for epoch, ratio in enumerate([0.25, 0.0625, 0.015625, 0.00390625, 0.001]):
        grace.set_epoch(epoch)
        assert grace.stats()["dgc_compress_ratio"] == ratio
        k, high = bounds(tensor.numel(), ratio)
        assert k <= int((grace.step(tensor, "w") != 0).sum()) <= high


def test_warmup_steps_per_tensor():
    comp = DGCCompressor(compress_ratio=0.001, warmup_steps=4)
    tensor = torch.randn(100, 100, generator=torch.Generator().manual_seed(2))
    for step in range(6):
        ratio = 0.001 ** (min(step + 1, 4) / 4)
        for name in ("a", "b"):  # each tensor advances its own counter
            payload, _ = comp.compress(tensor, name)
            k, high = bounds(tensor.numel(), ratio)
            assert k <= payload[1].numel() <= high
            assert comp.stats()["dgc_compress_ratio"] == pytest.approx(ratio)
    comp = DGCCompressor(compress_ratio=0.01, warmup_steps=4, warmup_ratios=[0.5, 0.1])
    assert [comp.ratio_at(s) for s in range(5)] == [0.5, 0.5, 0.1, 0.1, 0.01]


@pytest.mark.parametrize(
    "shape,dense_1d,dense",
    [
        ((5000,), True, True),
        ((20, 50), True, True),
        ((5000,), False, False),
        ((32, 32), True, False),
        ((), True, True),
        ((0, 7), True, True),
    ],
)
@pytest.mark.parametrize("fp16", [False, True])
def test_dense_rule_and_bytes(shape, dense_1d, dense, fp16):
    grace = grace_dgc.build(
        "dgc", "none", "allgather", engine="local", compress_ratio=0.01, dense_1d=dense_1d, fp16_values=fp16
    )
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    payload, ctx = grace.compressor.compress(tensor, "x")
    value_bytes = 2 if fp16 else 4
    assert payload[0].dtype == (torch.float16 if fp16 else torch.float32)
    out = grace.step(tensor, "x")
    if dense:
        assert len(payload) == 1 and payload[0].shape == (tensor.numel(),)
        assert grace.compressor.sent_mask(payload, ctx).all()
        assert torch.equal(out, tensor.half().float() if fp16 else tensor)
        assert grace.stats()["bytes_sent"] == 8 + tensor.numel() * value_bytes
    else:
        sent = payload[1].numel()
        k, high = bounds(tensor.numel(), 0.01)
        assert k <= sent <= high and payload[1].dtype == torch.int32
        expected = torch.zeros(tensor.numel())
        expected[payload[1].long()] = tensor.reshape(-1)[payload[1].long()]
        assert torch.equal(out.reshape(-1), expected.half().float() if fp16 else expected)
        assert grace.stats()["bytes_sent"] == 16 + sent * (value_bytes + 4)


# -- momentum memory against a hand-written reference ----------------------------------


class FakeEngine:
    def __init__(self, size):
        self.size, self.rank = size, 0


def reference_momentum(grads, params, k, m, nesterov, wd, clip, world):
    """numpy float64: clip → decay → momentum correction → exact top-k → masking."""
    u = np.zeros_like(grads[0])
    v = np.zeros_like(grads[0])
    sent_per_step = []
    for g, w in zip(grads, params):
        if clip is not None:
            limit = clip / math.sqrt(world)
            g = g * min(1.0, limit / (np.sqrt((g**2).sum()) + 1e-6))
        g = g + wd * w
        if nesterov:
            u = m * (u + g)
            v = v + u + g
        else:
            u = m * u + g
            v = v + u
        top = np.argsort(-np.abs(v), kind="stable")[:k]
        sent = np.zeros_like(v)
        sent[top] = v[top]
        sent_per_step.append(sent)
        v[top] = 0.0
        u[top] = 0.0
    return sent_per_step, u, v


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("clip", [None, 0.8])
def test_momentum_memory_matches_reference(nesterov, clip):
    n, k, steps, world = 300, 7, 6, 4
    rng = np.random.default_rng(5)
    grads = [rng.normal(size=n) * (1 + 3 * (t % 2)) for t in range(steps)]
    weights = [rng.normal(size=n) for _ in range(steps)]
    expected, u_ref, v_ref = reference_momentum(grads, weights, k, 0.9, nesterov, 0.01, clip, world)
    grace = grace_dgc.build(
        "topk",
        "momentum",
        "allgather",
        engine="local",
        compress_ratio=(k + 0.5) / n,
        momentum=0.9,
        nesterov=nesterov,
        weight_decay=0.01,
        gradient_clipping=clip,
    )
    grace.memory.bind(FakeEngine(world))  # clipping threshold scales with N^-1/2
    param = torch.zeros(n)
    grace.attach_optimizer(None, {"w": param})  # the parameters only (weight decay)
    for g, w, want in zip(grads, weights, expected):
        param.copy_(torch.from_numpy(w))
        out = grace.step(torch.from_numpy(g).float(), "w")
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grace.memory.momentums["w"].numpy(), u_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grace.memory.velocities["w"].numpy(), v_ref, rtol=1e-5, atol=1e-5)


def test_momentum_zero_is_error_feedback_and_masking_uses_sent_set():
    # m = 0: v accumulates exactly like the residual memory
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(40, 50, generator=gen) for _ in range(4)]
    a = grace_dgc.build("topk", "momentum", "allgather", engine="local", compress_ratio=0.02, momentum=0)
    b = grace_dgc.build("topk", "residual", "allgather", engine="local", compress_ratio=0.02)
    for g in grads:
        assert torch.allclose(a.step(g, "w"), b.step(g, "w"))
    # a sent exact zero is still "sent" for sparsifiers (index mask, not values != 0)
    mem = MomentumMemory(momentum=0.5)
    comp = grace_dgc.build("topk", "none", "allgather", compress_ratio=0.5).compressor
    v = mem.compensate(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), "z")
    payload = sparse_payload(torch.zeros(4), torch.tensor([0, 2]))  # two zeros at 0 and 2
    mem.update(v, "z", comp, payload, (torch.Size([1, 4]), torch.float32))
    assert torch.equal(mem.momentums["z"], torch.tensor([[0.0, 2.0, 0.0, 4.0]]))
    assert torch.equal(mem.velocities["z"], torch.tensor([[0.0, 2.0, 0.0, 4.0]]))


@pytest.mark.parametrize("compressor,communicator", [("dgc", "allgather"), ("none", "allreduce")])
def test_dense_payload_keeps_momentum(compressor, communicator):
    # a dense payload (DGC's bias path, or no compression) with the momentum memory is
    # plain momentum SGD: no factor masking
    grace = grace_dgc.build(compressor, "momentum", communicator, engine="local", momentum=0.9)
    gen = torch.Generator().manual_seed(7)
    buf = torch.zeros(10)
    for _ in range(4):
        g = torch.randn(10, generator=gen)
        g[3] = 0.0  # an element with zero gradient does not turn masking on
        buf = 0.9 * buf + g
        assert torch.allclose(grace.step(g, "bias"), buf, atol=1e-6)


# -- the SGD-momentum rule ---------------------------------------------------------------


def train(model, optimizer, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_moves_into_memory(nesterov, caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    twin = copy.deepcopy(model)
    groups = [
        {"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0},
    ]
    sgd = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=nesterov)
    grace = grace_dgc.build("none", "momentum", "allreduce", engine="local", momentum=0.5)
    with caplog.at_level(logging.WARNING, logger="grace_dgc"):
        opt = grace_dgc.DistributedOptimizer(sgd, grace, model.named_parameters())
    assert len([r for r in caplog.records if "took over SGD" in r.message]) == 1
    assert all(g["momentum"] == 0 and g["weight_decay"] == 0 and not g["nesterov"] for g in sgd.param_groups)
    assert grace.memory.settings["0.weight"] == (0.9, nesterov, 0.01)
    assert grace.memory.settings["0.bias"] == (0.9, nesterov, 0.0)
    twin_groups = [
        {"params": [p for n, p in twin.named_parameters() if n.endswith("weight")], "weight_decay": 0.01},
        {"params": [p for n, p in twin.named_parameters() if n.endswith("bias")], "weight_decay": 0},
    ]
    plain = torch.optim.SGD(twin_groups, lr=0.1, momentum=0.9, nesterov=nesterov)
    for got, want in zip(train(model, opt, 5, 1), train(twin, plain, 5, 1)):
        assert torch.allclose(got, want, atol=1e-6)


def test_sgd_rule_errors_and_weight_decay_needs_parameters():
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1)
    grace = grace_dgc.build("topk", "dgc", "allgather", engine="local")
    with pytest.raises(GraceConfigError, match="dampening"):
        grace_dgc.DistributedOptimizer(sgd, grace, model.named_parameters())
    grace = grace_dgc.build("topk", "momentum", "allgather", engine="local", weight_decay=1e-4)
    with pytest.raises(GraceConfigError, match="weight_decay needs the parameter"):
        grace.step(torch.randn(4, 4), "w")


def test_config_errors():
    for bad, word in [
        ({"compress_ratio": 0}, "compress_ratio"),
        ({"sample_ratio": 2}, "sample_ratio"),
        ({"warmup_epochs": 2, "warmup_steps": 3}, "warmup_steps"),
        ({"warmup_ratios": [0.5, 0.1], "warmup_epochs": 3}, "warmup_ratios"),
        ({"warmup_coeff": 1.5}, "warmup_coeff"),
        ({"threshold_decay": 1}, "threshold_decay"),
    ]:
        with pytest.raises(GraceConfigError, match=word):
            DGCCompressor(**bad)
    with pytest.raises(GraceConfigError, match="momentum"):
        MomentumMemory(momentum=1.0)
    with pytest.raises(GraceConfigError, match="allreduce"):
        grace_dgc.build("dgc", "dgc", "allreduce", engine="local")


# -- checkpoint round trip ---------------------------------------------------------------


def test_checkpoint_round_trip():
    params = dict(compress_ratio=0.01, warmup_steps=3, momentum=0.9, gradient_clipping=5.0)
    grace = grace_dgc.build("dgc", "dgc", "allgather", engine="local", **params)
    gen = torch.Generator().manual_seed(8)
    grads = [torch.randn(250, 200, generator=gen) for _ in range(6)]
    for g in grads[:3]:
        grace.step(g, "w")
    state = pickle.loads(pickle.dumps(grace.state_dict()))
    resumed = grace_dgc.build("dgc", "dgc", "allgather", engine="local", **params)
    resumed.load_state_dict(state)
    for g in grads[3:]:
        assert torch.equal(grace.step(g, "w"), resumed.step(g, "w"))
    assert resumed.compressor.steps == {"w": 6}


# -- two gloo ranks ------------------------------------------------------------------------

SHAPES = {"conv": (64, 3, 5, 5), "fc": (300, 100), "bias": (64,)}


def two_rank_worker(rank, world_size):
    params = dict(compress_ratio=0.01, momentum=0.9, gradient_clipping=50.0, seed=11)
    grace = grace_dgc.build("dgc", "dgc", "allgather", engine="torch", **params)
    shadow = grace_dgc.build("dgc", "dgc", "allgather", engine="local", **params)
    shadow.memory.bind(grace.engine)  # same clipping threshold as the real run
    gen = torch.Generator().manual_seed(100 + rank)
    results, own = [], []
    for _ in range(3):
        for name, shape in SHAPES.items():
            g = torch.randn(shape, generator=gen)
            results.append(grace.step(g, name))
            own.append(shadow.step(g, name))  # what this rank sent (local engine: not averaged)
    # DistributedOptimizer: SGD's momentum moves into the memory, ranks stay in sync
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        grace_dgc.build("dgc", "momentum", "allgather", engine="torch", compress_ratio=0.05),
        model.named_parameters(),
    )
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 40, generator=gen)).pow(2).mean().backward()
        opt.step()
    return results, own, [p.detach().clone() for p in model.parameters()], grace.stats()["bytes_sent"]


def test_two_ranks_dgc_momentum_allgather():
    (res0, own0, model0, bytes0), (res1, own1, model1, _) = run_ranks(two_rank_worker, 2)
    for a, b, s0, s1 in zip(res0, res1, own0, own1):
        assert torch.equal(a, b)  # ranks agree
        assert torch.allclose(a, (s0 + s1) / 2, atol=1e-6)  # the average of what each sent
    for a, b in zip(model0, model1):
        assert torch.equal(a, b)
    # sparse tensors sent between k and ⌊1.3k⌋ values each step (bias dense)
    for s, (name, shape) in zip(own0, list(SHAPES.items()) * 3):
        numel = math.prod(shape)
        k, high = bounds(numel, 0.01)
        nonzero = int((s != 0).sum())
        assert (nonzero == numel) if name == "bias" else (k <= nonzero <= high)
    assert bytes0 > 0


def test_plain_sgd_checkpoint_does_not_bring_momentum_back():
    """Loading a plain SGD state dict (momentum 0.9 in its groups) into a DistributedOptimizer
    whose memory is `momentum` hands the momentum to the memory again."""
    import grace_dgc

    model = torch.nn.Linear(4, 2)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict()
    opt = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        grace_dgc.build("none", "momentum", engine="local"),
        model.named_parameters(),
    )
    opt.load_state_dict(plain)
    assert opt.param_groups[0]["momentum"] == 0
    assert all(s[0] == 0.9 for s in opt.grace.memory.settings.values())


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adam, torch.optim.RMSprop])
def test_the_momentum_memory_under_an_optimizer_with_moments_is_refused_unless_momentum_is_0(optimizer):
    """Issue 26: DGC's momentum on top of Adam's moments applied momentum twice, silently."""
    model = torch.nn.Linear(6, 3)
    grace = grace_dgc.build("dgc", "momentum", "allgather", engine="local", compress_ratio=0.3, min_compress_size=1)
    refused = rf"{optimizer.__name__} applies moments of its own.*momentum=0"
    with pytest.raises(grace_dgc.GraceConfigError, match=refused):
        grace_dgc.DistributedOptimizer(optimizer(model.parameters(), lr=0.01), grace, model.named_parameters())
    # momentum=0: DGC's accumulation alone (u = g, v += u, masked), Adam's moments do the rest
    accumulate = grace_dgc.build("topk", "momentum", "allgather", engine="local", compress_ratio=0.3, momentum=0)
    residual = grace_dgc.build("topk", "residual", "allgather", engine="local", compress_ratio=0.3)
    torch.manual_seed(0)
    twin = torch.nn.Linear(6, 3)
    twin.load_state_dict(model.state_dict())
    a = grace_dgc.DistributedOptimizer(optimizer(model.parameters(), lr=0.01), accumulate, model.named_parameters())
    b = grace_dgc.DistributedOptimizer(optimizer(twin.parameters(), lr=0.01), residual, twin.named_parameters())
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for opt, net in ((a, model), (b, twin)):
            opt.zero_grad()
            net(x).square().sum().backward()
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_only_rank_0_says_the_momentum_memory_took_over_sgds_momentum(caplog):
    """Every rank takes over the same settings (the handshake compares them): one line, not one
    per rank (a survey's log showed it ten times)."""
    from grace_dgc.engines.local import PlanEngine

    class Rank1(PlanEngine):
        rank = 1

    for engine, lines in ((PlanEngine(2), 1), (Rank1(2), 0)):
        model = torch.nn.Linear(3, 2)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        grace = grace_dgc.build("none", "momentum", "allreduce", engine=engine)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="grace_dgc"):
            grace.attach_optimizer(sgd, dict(model.named_parameters()))
        assert len([r for r in caplog.records if "took over SGD" in r.message]) == lines
        assert sgd.param_groups[0]["momentum"] == 0  # taken over on every rank alike
