"""1-bit Adam and 0/1 Adam (issue 40): the schedules against reference loops written here
(plain tensors, a loop over ranks, no grace_dgc), on 1, 2 and 3 gloo ranks, every rank
bitwise alike; the warm-up against torch's own AdamW; resume bit for bit (after a skipped
step too); the compressor and communicator as choices; refusals."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from ranks import run_ranks

import grace_dgc
from grace_dgc import schedules
from grace_dgc.errors import GraceConfigError

LR, BETAS, EPS, DECAY = 0.05, (0.9, 0.999), 1e-8, 0.01
SIGN = ("efsignsgd", "residual", "reduce_scatter", {"scale": "rms"})  # the papers' compressed allreduce


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.w = torch.nn.Parameter(torch.randn(5, 6, generator=gen) * 0.3)
        self.b = torch.nn.Parameter(torch.zeros(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w, self.b)


def batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 5, generator=gen)


def gradient(params: dict[str, torch.Tensor], rank: int, t: int, poison: tuple | None = None) -> dict:
    """The gradient of rank's batch at step t, through the same torch ops as the model."""
    leaves = {n: p.clone().requires_grad_() for n, p in params.items()}
    x, y = batch(rank, t)
    F.mse_loss(F.linear(x, leaves["w"], leaves["b"]), y).backward()
    grads = {n: leaf.grad for n, leaf in leaves.items()}
    if poison == (rank, t):
        grads["w"][0, 0] = float("nan")
    return grads


# -- the reference: written out, a loop over ranks -----------------------------------------------------


def lr_of(t: int) -> float:
    """The lr of step t: it changes every step (an LR schedule), so Σγ and a resume's group dicts count."""
    return LR * (1 + 0.25 * (t % 3))


def rms_sign(x: torch.Tensor) -> torch.Tensor:
    """(‖x‖₂/√d)·sign(x), with sign(0) = +1, in fp32 (DeepSpeed's norm / √numel)."""
    scale = torch.linalg.vector_norm(x, dtype=torch.float32) / math.sqrt(max(x.numel(), 1))
    return torch.where(x >= 0, scale, -scale)


class CompressedAllreduce:
    """1-bit Adam's error-compensated allreduce, cut into N owner chunks: each rank sends
    rms_sign of each chunk of (x + worker error), the owner of chunk j averages, adds its
    server error and sends rms_sign again."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.worker: list[dict] = [{} for _ in range(world)]
        self.server: list[dict] = [{} for _ in range(world)]

    def __call__(self, name: str, xs: list[torch.Tensor]) -> torch.Tensor:
        n, shape = self.world, xs[0].shape
        numel = xs[0].numel()
        bounds = [numel * j // n for j in range(n + 1)]
        sent = []
        for r, x in enumerate(xs):
            p = x.reshape(-1) + self.worker[r][name] if name in self.worker[r] else x.reshape(-1).clone()
            c = torch.cat([rms_sign(p[bounds[j] : bounds[j + 1]]) for j in range(n)])
            self.worker[r][name] = p - c
            sent.append(c)
        out = []
        for j in range(n):
            chunks = [c[bounds[j] : bounds[j + 1]] for c in sent]
            a = (torch.stack(chunks).sum(dim=0) if n > 1 else chunks[0]) / n
            if name in self.server[j]:
                a = a + self.server[j][name]
            c = rms_sign(a)
            self.server[j][name] = a - c
            out.append(c * n / n if n > 1 else c)
        return torch.cat(out).view(shape)


def dense_mean(xs: list[torch.Tensor]) -> torch.Tensor:
    return (torch.stack(xs).sum(dim=0) / len(xs)) if len(xs) > 1 else xs[0].clone()


def adamw_update(p, m, v, lr, t_m, t_v, bias_correction=True):
    first = 1 - BETAS[0] ** t_m if bias_correction else 1.0
    second = 1 - BETAS[1] ** t_v if bias_correction else 1.0
    p = p * (1 - lr * DECAY)
    return p.addcdiv((m), (v.sqrt() / second**0.5).add(EPS), value=-lr / first)


def clip(grads: dict, max_norm: float | None) -> dict:
    """torch's clip_grad_norm_ arithmetic on a dict of tensors: the global L2 norm, one factor."""
    if max_norm is None:
        return grads
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {n: g * factor for n, g in grads.items()}


def reference_onebit_adam(
    world: int, steps: int, freeze: int, poison: tuple | None = None, max_norm: float | None = None
) -> dict:
    params = {n: p.detach().clone() for n, p in Tiny().named_parameters()}
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    allreduce, t = CompressedAllreduce(world), 0
    for step in range(1, steps + 1):
        grads = [gradient(params, r, step, poison) for r in range(world)]
        if any(not torch.isfinite(g).all() for gs in grads for g in gs.values()):
            continue  # skipped alike on every rank: nothing changes
        t += 1
        if t <= freeze:  # the dense average is clipped, else each rank's own gradient
            average = clip({n: dense_mean([gs[n] for gs in grads]) for n in params}, max_norm)
        else:
            grads = [clip(gs, max_norm) for gs in grads]
        for n in params:
            if t <= freeze:
                g = average[n]
                m[n] = torch.lerp(m[n], g, 1 - BETAS[0])
                v[n] = torch.addcmul(v[n] * BETAS[1], g, g, value=1 - BETAS[1])
            else:
                mine = [torch.lerp(m[n], gs[n], 1 - BETAS[0]) for gs in grads]
                m[n] = allreduce(n, mine).masked_fill(v[n] == 0, 0)
            params[n] = adamw_update(params[n], m[n], v[n], lr_of(step), t, min(t, freeze))
    return params


def reference_zero_one_adam(
    world: int, steps: int, freeze: int, kappa: int, scaler: int, clipper: int, poison: tuple | None = None
) -> list[dict]:
    """Every rank's parameters after ``steps`` (they differ between synchronizations): 0/1 Adam
    with bias correction, AdamW's decay as the factor D outside the synchronized sum, and a
    rank whose local gradient is not finite taking the decay only."""
    start = {n: p.detach().clone() for n, p in Tiny().named_parameters()}
    params = [{n: p.clone() for n, p in start.items()} for _ in range(world)]
    m = [{n: torch.zeros_like(p) for n, p in start.items()} for _ in range(world)]
    v = {n: torch.zeros_like(p) for n, p in start.items()}
    starts: list[dict] = []  # p₀, the parameters each rank's round of local steps started from
    allreduce = CompressedAllreduce(world)
    var_interval, var_counter, var_updates, local_interval, local_counter = 1, 0, 0, 1, 0
    lrs, decay = 0.0, 1.0  # Σγ and D of the round

    def denominator(n):  # √v̂ + ε
        return (v[n].sqrt() / (1 - BETAS[1] ** max(var_updates, 1)) ** 0.5).add(EPS)

    for t in range(1, steps + 1):
        lr = lr_of(t)
        step_size, factor = lr / (1 - BETAS[0] ** t), 1 - lr * DECAY
        grads = [gradient(params[r], r, t, poison) for r in range(world)]
        if t <= freeze:
            dense = t % var_interval == 0
            var_updates += dense
            for n in start:
                if dense:
                    g = dense_mean([gs[n] for gs in grads])
                    v[n] = torch.addcmul(v[n] * BETAS[1], g, g, value=1 - BETAS[1])
                else:
                    g = allreduce(n, [gs[n] for gs in grads]).masked_fill(v[n] == 0, 0)
                for r in range(world):
                    m[r][n] = torch.lerp(m[r][n], g, 1 - BETAS[0])
                    params[r][n] = torch.addcdiv(params[r][n] * factor, m[r][n], denominator(n), value=-step_size)
            if dense:
                var_counter += 1
                if var_counter == kappa:
                    var_counter, var_interval = 0, var_interval * 2
            continue
        if t == freeze + 1:
            allreduce = CompressedAllreduce(world)  # the errors start again for the momentum sums
            starts = [{n: p.clone() for n, p in params[r].items()} for r in range(world)]
        for r in range(world):
            finite = all(torch.isfinite(g).all() for g in grads[r].values())
            for n in start:
                if finite:
                    m[r][n] = torch.lerp(m[r][n], grads[r][n], 1 - BETAS[0])
                    params[r][n] = torch.addcdiv(params[r][n] * factor, m[r][n], denominator(n), value=-step_size)
                else:  # its own gradient is not finite: the decay only
                    params[r][n] = params[r][n] * factor
        lrs, decay = lrs + step_size, decay * factor
        if t % local_interval == 0:
            for n in start:
                d = denominator(n)
                sums = [torch.sub(params[r][n], starts[r][n], alpha=decay) * d for r in range(world)]
                average = allreduce(n, sums).masked_fill(v[n] == 0, 0)
                for r in range(world):
                    params[r][n] = torch.add(starts[r][n] * decay, average / d)
                    starts[r][n] = params[r][n].clone()
                    m[r][n] = average / -lrs
            lrs, decay = 0.0, 1.0
        local_counter += 1
        if local_counter == scaler:
            local_counter, local_interval = 0, min(clipper, local_interval * 2)
    return params


# -- grace_dgc's side ---------------------------------------------------------------------------------


def build(schedule: str, engine: str, parts=SIGN, **settings):
    model = Tiny()
    compressor, memory, communicator, params = parts
    grace = grace_dgc.build(compressor, memory, communicator, engine=engine, **params)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
    return model, schedules.create(schedule, opt, grace, model.named_parameters(), fusion_bytes=0, **settings)


def train(model, opt, rank: int, first: int, last: int, poison: tuple | None = None) -> None:
    for t in range(first, last + 1):
        for group in opt.param_groups:
            group["lr"] = lr_of(t)
        opt.zero_grad()
        x, y = batch(rank, t)
        F.mse_loss(model(x), y).backward()
        if poison == (rank, t):
            with torch.no_grad():
                model.w.grad[0, 0] = float("nan")
        opt.step()


def flat(params: dict) -> torch.Tensor:
    return torch.cat([params[n].reshape(-1) for n in ("w", "b")])


ONEBIT = {"freeze_step": 3, "max_grad_norm": 1.2}  # clips some steps: the batches' gradient norms are 0.7-1.8
ZERO_ONE = {"var_freeze_step": 9, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}
STEPS = 16  # 0/1 Adam: synchronizes at 10, 11, 12 (H = 2), then 16 (H = 4): ranks agree at the end


def ranks_job(rank: int, world: int, engine: str = "torch") -> dict:
    out: dict = {}
    model, opt = build("onebit_adam", engine, **ONEBIT)
    train(model, opt, rank, 1, STEPS, poison=(world - 1, 5))
    out["onebit"] = flat(dict(model.named_parameters())).detach()
    out["onebit_skipped"] = opt.stats()["skipped_steps"]
    model, opt = build("zero_one_adam", engine, **ZERO_ONE)
    train(model, opt, rank, 1, STEPS, poison=(world - 1, 13))  # a local step of the last rank's is skipped
    out["zero_one"] = flat(dict(model.named_parameters())).detach()
    out["zero_one_stats"] = dict({k: opt.stats()[k] for k in ("bytes_sent", "dense_bytes_sent")}, phase=opt.phase())
    return out


def reference_results(world: int) -> dict:
    return {
        "onebit": flat(reference_onebit_adam(world, STEPS, 3, poison=(world - 1, 5), max_norm=ONEBIT["max_grad_norm"])),
        "zero_one": [
            flat(p)
            for p in reference_zero_one_adam(
                world, STEPS, ZERO_ONE["var_freeze_step"], 2, ZERO_ONE["local_step_scaler"], 4, poison=(world - 1, 13)
            )
        ],
    }


def test_one_rank_equals_the_reference_loops_bit_for_bit():
    got = ranks_job(0, 1, engine="local")
    expected = reference_results(1)
    assert torch.equal(got["onebit"], expected["onebit"])
    assert got["onebit_skipped"] == 1
    assert torch.equal(got["zero_one"], expected["zero_one"][0])


@pytest.mark.fast
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_bitwise_and_equal_the_reference_loops(world):
    outs = run_ranks(ranks_job, world)
    expected = reference_results(world)
    for out in outs[1:]:
        assert torch.equal(out["onebit"], outs[0]["onebit"])
        assert torch.equal(out["zero_one"], outs[0]["zero_one"])
    # a gloo sum of 3 ranks need not add in the reference's order: exact on 2, to fp32 rounding on 3
    close = torch.equal if world == 2 else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    assert close(outs[0]["onebit"], expected["onebit"])
    assert all(o["onebit_skipped"] == 1 for o in outs)
    for rank, out in enumerate(outs):
        assert close(out["zero_one"], expected["zero_one"][rank])
    stats = outs[0]["zero_one_stats"]
    assert stats["phase"] == "local steps" and 0 < stats["bytes_sent"] - stats["dense_bytes_sent"]


@pytest.mark.parametrize("clip", [None, 0.05])
def test_the_warm_up_is_torch_adamw_and_adam_bit_for_bit(clip):
    """Also with clipping: clip_grad_norm_ on the (averaged) gradient, then torch's step."""

    def clipped(optimizer, model):
        class Clipped:
            param_groups = optimizer.param_groups

            def zero_grad(self):
                optimizer.zero_grad()

            def step(self):
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()

        return Clipped() if clip else optimizer

    for kind in (torch.optim.AdamW, torch.optim.Adam):
        model, twin = Tiny(), Tiny()
        grace = grace_dgc.build(*SIGN[:3], engine="local", **SIGN[3])
        opt = schedules.create(
            "onebit_adam",
            kind(model.parameters(), lr=LR, weight_decay=DECAY),
            grace,
            model.named_parameters(),
            freeze_step=6,
            max_grad_norm=clip,
        )
        plain = clipped(kind(twin.parameters(), lr=LR, weight_decay=DECAY), twin)
        for t in range(1, 7):
            train(model, opt, 0, t, t)
            train(twin, plain, 0, t, t)
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters())), (kind, t)
        stats = opt.stats()  # the warm-up is all dense: what an fp32 allreduce of 35 elements hands over
        assert stats["bytes_sent"] == stats["dense_bytes_sent"] == stats["dense_bytes"] == 6 * 35 * 4


# -- resume ------------------------------------------------------------------------------------------


def resume_job(rank: int, world: int, schedule: str, settings: dict, stop: int, poison: tuple | None) -> dict:
    model, opt = build(schedule, "torch", **settings)
    train(model, opt, rank, 1, STEPS, poison)
    whole = flat(dict(model.named_parameters())).detach()
    model, opt = build(schedule, "torch", **settings)
    train(model, opt, rank, 1, stop, poison)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    model, opt = build(schedule, "torch", **settings)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    train(model, opt, rank, stop + 1, STEPS, poison)
    return {"whole": whole, "resumed": flat(dict(model.named_parameters())).detach()}


@pytest.mark.parametrize(
    "schedule, settings, stop, poison",
    [
        ("onebit_adam", ONEBIT, 6, (1, 5)),  # after the freeze, a skipped step before the save
        ("onebit_adam", ONEBIT, 2, (0, 4)),  # in the warm-up, the skip after the resume
        ("zero_one_adam", ZERO_ONE, 13, None),  # mid-round of the local steps (H = 4: 13 to 16)
        ("zero_one_adam", ZERO_ONE, 4, (1, 3)),  # between variance steps, after a skipped step
    ],
)
def test_resume_is_bit_for_bit(schedule, settings, stop, poison):
    for out in run_ranks(resume_job, 2, (schedule, settings, stop, poison)):
        assert torch.equal(out["whole"], out["resumed"])


# -- the compressor and the communicator are choices -----------------------------------------------------


CHOICES = [
    ("topk", "residual", "allgather", {"compress_ratio": 0.3}),
    ("qsgd", "residual", "reduce_scatter", {"quantum_num": 15}),
    ("thc", "residual", "allreduce", {}),
    ("onebit", "residual", "allgather", {}),
]


def choices_job(rank: int, world: int) -> list:
    out = []
    for parts in CHOICES:
        for schedule, settings in (("onebit_adam", ONEBIT), ("zero_one_adam", ZERO_ONE)):
            model, opt = build(schedule, "torch", parts=parts, **settings)
            train(model, opt, rank, 1, STEPS)
            stats = opt.stats()
            out.append((parts[0], schedule, flat(dict(model.named_parameters())).detach(), stats["bytes_sent"]))
    return out


def test_any_compressor_and_communicator_carry_the_momentum():
    ranks = run_ranks(choices_job, 2)
    for mine, theirs in zip(*ranks):
        assert mine[:2] == theirs[:2]
        assert torch.equal(mine[2], theirs[2]), mine[:2]  # bitwise in sync
        assert torch.isfinite(mine[2]).all() and mine[3] > 0


# -- one rank: the mask, stats, refusals ----------------------------------------------------------------


@pytest.mark.parametrize("mask", [True, False])
def test_the_momentum_mask_keeps_never_used_elements_still(mask):
    model = Tiny()
    grace = grace_dgc.build(*SIGN[:3], engine="local", **SIGN[3])
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0)
    opt = schedules.create("onebit_adam", adamw, grace, model.named_parameters(), freeze_step=2, momentum_mask=mask)
    before = model.w.detach()[:, 5].clone()
    for t in range(1, 8):
        opt.zero_grad()
        x, y = batch(0, t)
        x[:, 5] = 0  # column 5 of w never gets a gradient: its v stays 0
        F.mse_loss(model(x), y).backward()
        opt.step()
    # unmasked, the sign's error lands on those elements and is divided by √0 + ε
    assert torch.equal(model.w.detach()[:, 5], before) == mask
    assert (torch.count_nonzero(opt.exp_avg["w"][:, 5]) == 0) == mask
    assert opt.phase() == "compressed"


def test_refusals_name_what_is_accepted():
    model = Tiny()

    def grace():
        return grace_dgc.build(*SIGN[:3], engine="local", **SIGN[3])

    with pytest.raises(GraceConfigError, match="torch.optim.Adam or torch.optim.AdamW"):
        schedules.create("onebit_adam", torch.optim.SGD(model.parameters(), lr=0.1), grace())
    with pytest.raises(GraceConfigError, match="amsgrad=True"):
        schedules.create("zero_one_adam", torch.optim.Adam(model.parameters(), amsgrad=True), grace())
    with pytest.raises(GraceConfigError, match="freeze_step"):
        schedules.create("onebit_adam", torch.optim.Adam(model.parameters()), grace(), freeze_step=0)
    with pytest.raises(GraceConfigError, match="scale='l2'"):
        grace_dgc.build("efsignsgd", engine="local", scale="l2")
    _, one = build("onebit_adam", "local", **ONEBIT)
    _, zero = build("zero_one_adam", "local", **ZERO_ONE)
    with pytest.raises(GraceConfigError, match="saved by schedule 'onebit_adam'"):
        zero.load_state_dict(one.state_dict())
    _, other = build("onebit_adam", "local", freeze_step=4)
    with pytest.raises(GraceConfigError, match="freeze_step: saved 3, this run 4"):
        other.load_state_dict(one.state_dict())


def test_registered_by_name_with_aliases():
    assert {"onebit_adam", "zero_one_adam"} <= set(schedules.list_schedules())
    assert schedules.SCHEDULES.canonical("1bit_adam") == "onebit_adam"
    assert schedules.SCHEDULES.canonical("01adam") == "zero_one_adam"
    assert schedules.accepted_params("onebit_adam") == [
        "freeze_step",
        "bias_correction",
        "momentum_mask",
        "max_grad_norm",
        "fusion_bytes",
    ]


# -- the warning where error feedback meets Adam --------------------------------------------------------


@pytest.mark.parametrize(
    "compressor, memory, optimizer, warned",
    [
        ("topk", "residual", torch.optim.AdamW, True),
        ("dgc", "momentum", torch.optim.Adam, True),  # DGC's accumulation (momentum=0) under Adam
        ("efsignsgd", "efsignsgd", torch.optim.RMSprop, True),
        ("randomk", "residual", torch.optim.Adagrad, True),
        ("powersgd", "powersgd", torch.optim.AdamW, True),
        ("topk", "none", torch.optim.AdamW, False),  # no error feedback: not the composition
        ("qsgd", "residual", torch.optim.AdamW, False),  # unbiased: not the composition
        ("fp16", "residual", torch.optim.AdamW, False),
        ("topk", "residual", torch.optim.SGD, False),  # SGD has no per-coordinate moments
        ("topk", "ef21", torch.optim.AdamW, False),  # EF21 is not classic error feedback: not measured
    ],
)
def test_error_feedback_under_adam_is_warned_once_and_only_there(caplog, compressor, memory, optimizer, warned):
    from grace_dgc.memories import adaptive as grace_module

    grace_module._warned_compositions.clear()
    params = {"momentum": 0.0} if memory == "momentum" else {}
    communicator = "allgather"
    for _ in range(2):  # once, however often it is wrapped
        model = Tiny()
        grace = grace_dgc.build(compressor, memory, communicator, engine="local", **params)
        with caplog.at_level("WARNING", logger="grace_dgc"):
            grace_dgc.DistributedOptimizer(optimizer(model.parameters(), lr=0.1), grace, model.named_parameters())
    lines = [r.getMessage() for r in caplog.records if "error-feedback memory" in r.getMessage()]
    assert len(lines) == (1 if warned else 0), lines
    if warned:
        assert compressor in lines[0] and optimizer.__name__ in lines[0] and "onebit_adam" in lines[0]


def test_a_plugin_adam_is_recognised_by_its_defaults_and_the_ddp_hook_warns_too(caplog):
    from grace_dgc.memories import adaptive as grace_module

    class PluginAdam(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8})

    grace_module._warned_compositions.clear()
    model = Tiny()
    grace = grace_dgc.build("topk", "residual", "allgather", engine="local")
    with caplog.at_level("WARNING", logger="grace_dgc"):
        grace_dgc.ddp_comm_hook(grace, model, PluginAdam(model.parameters()))
    assert any("PluginAdam" in r.getMessage() for r in caplog.records)


# -- the survey: AdamW workloads, the lr schedule, the Adam schedules by name, the loss gap ---------------


def disagreeing_job(rank: int, world: int) -> str:
    model, opt = build("onebit_adam", "torch", freeze_step=3 + rank)  # the ranks disagree on the freeze
    try:
        train(model, opt, rank, 1, 2)
    except GraceConfigError as error:
        return str(error)
    return "trained"


def test_ranks_with_other_settings_are_refused_at_the_first_exchange():
    for message in run_ranks(disagreeing_job, 2):
        assert "freeze_step" in message, message


def test_the_rms_scale_squares_in_fp32_whatever_the_gradient_dtype():
    compressor = grace_dgc.build("efsignsgd", "none", "allgather", engine="local", scale="rms").compressor
    for value in (1e-4, 300.0):  # fp16 squares would underflow to 0 and overflow to inf
        tensor = torch.full((10,), value, dtype=torch.float16)
        (_, scale), _ = compressor.compress(tensor, "w")
        expected = torch.linalg.vector_norm(tensor.float()) / math.sqrt(10)
        assert torch.equal(scale, expected.reshape(1))


@pytest.mark.launches
def test_with_deepspeeds_compressed_allreduce_onebit_adam_is_deepspeed_bit_for_bit():
    """benchmarks/compare_deepspeed_adam.py: DeepSpeed 0.19.6's own trajectories (kept in
    benchmarks/data) against the schedules with DeepSpeed's compressed allreduce as a plugin
    communicator: both schedules' final parameters within 1e-6 of DeepSpeed's (1-bit Adam's bit
    for bit on the recording machine; another CPU's float32 norms round differently). In a process of its own: the
    plugin communicator must not join this process's registry."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent.parent / "benchmarks" / "compare_deepspeed_adam.py"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # within 1e-6 everywhere; bit for bit where DeepSpeed's trajectories were recorded (the script's docstring)
    assert done.stdout.count("+ DeepSpeed's allreduce bit for bit: ") == 2
