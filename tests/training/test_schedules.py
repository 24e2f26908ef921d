"""Synchronization schedules (grace_dgc.schedules): DiLoCo and local SGD over any Grace.

One rank checks the arithmetic against a reference written out here (inner SGD steps, then
the outer Nesterov step on Δ = θ_start − θ by hand), checkpoints, stats and errors; 2 and 3
gloo ranks check that ranks agree bitwise after every synchronization, differ between them,
send nothing between them, and that local SGD lands on the average of the ranks' models.
"""

import io

import pytest
import torch
from ranks import run_ranks
from test_distributed import batches, make_model  # the same tiny model and per-rank batches

import grace_dgc
from grace_dgc import schedules
from grace_dgc.errors import GraceConfigError


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def train_step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return opt.step()


def local_grace(compressor="none", memory="none", communicator="allreduce", **params):
    return grace_dgc.build(compressor, memory, communicator, engine="local", **params)


# -- the registry --------------------------------------------------------------------------


def test_two_schedules_are_registered_with_the_papers_defaults():
    assert schedules.list_schedules() == [
        "diloco",
        "local_sgd",
        "onebit_adam",
        "sparseloco",
        "streaming_diloco",
        "zero_one_adam",
    ]
    model = make_model()
    diloco = schedules.create("diloco", torch.optim.SGD(model.parameters(), lr=0.1), local_grace())
    assert isinstance(diloco, schedules.DiLoCo)
    assert (diloco.outer_lr, diloco.outer_momentum, diloco.nesterov) == (0.7, 0.9, True)
    group = diloco.outer_optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True)
    local = schedules.create("localsgd", torch.optim.SGD(model.parameters(), lr=0.1), local_grace(), inner_steps=4)
    assert isinstance(local, schedules.LocalSGD) and local.name == "local_sgd"
    assert (local.outer_lr, local.outer_momentum, local.nesterov, local.inner_steps) == (1.0, 0.0, False, 4)
    assert grace_dgc.list_schedules() == schedules.list_schedules()


# -- (a) one rank: the arithmetic of Algorithm 1 ---------------------------------------------------


def test_one_rank_diloco_equals_inner_sgd_then_outer_nesterov_written_out():
    H, rounds, inner_lr, eta, mu = 3, 3, 0.1, 0.7, 0.9
    model = make_model()
    data = batches(0, H * rounds)
    sched = schedules.create(
        "diloco",
        torch.optim.SGD(model.parameters(), lr=inner_lr),
        local_grace(),
        model.named_parameters(),
        inner_steps=H,
    )

    reference = make_model()  # the same initial parameters, stepped by hand
    theta = [p.detach().clone() for p in reference.parameters()]
    start = [t.clone() for t in theta]
    m = [torch.zeros_like(t) for t in theta]
    for step, (x, y) in enumerate(data):
        train_step(model, sched, x, y)
        # inner SGD: θ ← θ − lr·g on this rank's batch
        for p, t in zip(reference.parameters(), theta):
            p.data.copy_(t)
        reference.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        theta = [t - inner_lr * p.grad for t, p in zip(theta, reference.parameters())]
        if (step + 1) % H == 0:  # outer: Δ = θ_start − θ; m ← μm + Δ; θ ← θ_start − η(Δ + μm)
            delta = [s - t for s, t in zip(start, theta)]
            m = [mu * b + d for b, d in zip(m, delta)]
            theta = [s - eta * (d + mu * b) for s, d, b in zip(start, delta, m)]
            start = [t.clone() for t in theta]
        else:
            assert sched.since_sync == (step + 1) % H
        for p, t in zip(model.parameters(), theta):
            torch.testing.assert_close(p.detach(), t, rtol=1e-5, atol=1e-6)
    assert sched.syncs == rounds
    # the outer momentum buffer persisted across rounds: it is the hand-written m
    for p, b in zip(model.parameters(), m):
        torch.testing.assert_close(sched.outer_optimizer.state[p]["momentum_buffer"], b, rtol=1e-5, atol=1e-6)


def test_the_inner_gradients_are_given_back_after_the_outer_step():
    model = make_model()
    sched = schedules.create(
        "diloco", torch.optim.SGD(model.parameters(), lr=0.1), local_grace(), model.named_parameters(), inner_steps=1
    )
    x, y = batches(0, 1)[0]
    sched.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    copies = [g.clone() for g in grads]
    sched.step()  # inner step and a synchronization
    assert sched.syncs == 1
    assert all(p.grad is g and torch.equal(g, c) for p, g, c in zip(model.parameters(), grads, copies))


def test_synchronize_now_ends_the_round_and_is_a_no_op_right_after_one():
    model = make_model()
    sched = schedules.create(
        "diloco", torch.optim.SGD(model.parameters(), lr=0.1), local_grace(), model.named_parameters(), inner_steps=5
    )
    assert not sched.synchronize_now()  # nothing to exchange before the first step
    for x, y in batches(0, 2):
        train_step(model, sched, x, y)
    before = flat(model)
    assert sched.synchronize_now() and sched.syncs == 1 and sched.since_sync == 0
    assert not torch.equal(flat(model), before)  # the outer step moved θ (η = 0.7 of the way, plus momentum)
    after = flat(model)
    assert not sched.synchronize_now()  # a zero Δ must not move θ by the momentum
    assert torch.equal(flat(model), after)


def test_an_lr_scheduler_acts_on_the_inner_optimizer():
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = schedules.create("local_sgd", inner, local_grace(), model.named_parameters(), inner_steps=2)
    lr_schedule = torch.optim.lr_scheduler.StepLR(sched, step_size=1, gamma=0.5)
    for x, y in batches(0, 2):
        train_step(model, sched, x, y)
        lr_schedule.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.025)
    assert sched.outer_optimizer.param_groups[0]["lr"] == 1.0


def test_a_non_finite_outer_gradient_drops_the_round():
    model = make_model()
    sched = schedules.create(
        "diloco", torch.optim.SGD(model.parameters(), lr=0.1), local_grace(), model.named_parameters(), inner_steps=2
    )
    data = batches(0, 4)
    for x, y in data[:2]:
        train_step(model, sched, x, y)
    start = flat(model)  # after the first synchronization
    train_step(model, sched, *data[2])
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    train_step(model, sched, *data[3])  # the second synchronization: Δ holds a NaN
    assert torch.equal(flat(model), start)  # back to the start of the round, no outer step
    stats = sched.stats()
    assert (stats["syncs"], stats["skipped_syncs"]) == (1, 1)


# -- (b), (c) several ranks --------------------------------------------------------------------


def schedule_job(rank, world_size, name, grace_args, params, steps):
    """Train with schedule ``name``; per step: the parameters after the inner step (before any
    synchronization: the inner optimizer's post-step hook), after ``step()``, and bytes sent."""
    model = make_model(seed=rank)  # different on every rank until broadcast
    grace_dgc.broadcast_parameters(model.state_dict(), root_rank=0)
    inner = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if name == "local_sgd"
        else torch.optim.AdamW(model.parameters(), lr=0.01)
    )
    comp, mem, comm, kwargs = grace_args
    grace = grace_dgc.build(comp, mem, comm, **kwargs)
    sched = schedules.create(name, inner, grace, model.named_parameters(), **params)
    local = []
    inner.register_step_post_hook(lambda opt, args, kw: local.append(flat(model)))
    after, sent = [], []
    for x, y in batches(rank, steps):
        train_step(model, sched, x, y)
        after.append(flat(model))
        sent.append(sched.stats()["bytes_sent"])
    forced = sched.synchronize_now()
    return {
        "local": local,
        "after": after,
        "sent": sent,
        "forced": forced,
        "final": flat(model),
        "again": sched.synchronize_now(),
        "stats": sched.stats(),
        "residuals": {k: v.clone() for k, v in grace.state_dict()["memory"].get("residuals", {}).items()},
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_local_sgd_averages_the_ranks_models_every_h_steps_and_sends_nothing_between(world_size):
    H, steps = 3, 7
    results = run_ranks(
        schedule_job, world_size, ("local_sgd", ("none", "none", "allreduce", {}), {"inner_steps": H}, steps)
    )
    numel = results[0]["after"][0].numel()
    for step in range(steps):
        afters = [r["after"][step] for r in results]
        sents = [r["sent"][step] for r in results]
        previous = [r["sent"][step - 1] if step else 0 for r in results]
        if (step + 1) % H == 0:
            average = torch.stack([r["local"][step] for r in results]).mean(0)
            for after in afters:
                assert torch.equal(after, afters[0]), (step, "ranks differ after a synchronization")
                torch.testing.assert_close(after, average, rtol=1e-6, atol=1e-6)
            assert [s - p for s, p in zip(sents, previous)] == [numel * 4] * world_size  # Δ, dense fp32
        else:
            for r in results:  # no synchronization: the parameters are the inner step's
                assert torch.equal(r["after"][step], r["local"][step])
            assert not torch.equal(afters[0], afters[1]), (step, "ranks should differ between synchronizations")
            assert sents == previous, (step, "bytes sent between synchronizations")
    # the last partial round, forced: the average of where the ranks ended
    assert all(r["forced"] and not r["again"] for r in results)
    average = torch.stack([r["after"][-1] for r in results]).mean(0)
    for r in results:
        assert torch.equal(r["final"], results[0]["final"])
        torch.testing.assert_close(r["final"], average, rtol=1e-6, atol=1e-6)
        assert (r["stats"]["syncs"], r["stats"]["steps"]) == (3, steps)


def resume_job(rank, world_size, grace_args, params, steps, cut):
    """The same DiLoCo run uninterrupted and checkpointed after ``cut`` steps (through
    torch.save/torch.load(weights_only=True)), resumed in a fresh model, optimizer and Grace."""
    comp, mem, comm, kwargs = grace_args
    data = batches(rank, steps)

    def build(seed):
        model = make_model(seed)
        sched = schedules.create(
            "diloco",
            torch.optim.AdamW(model.parameters(), lr=0.01),
            grace_dgc.build(comp, mem, comm, **kwargs),
            model.named_parameters(),
            **params,
        )
        return model, sched

    model, sched = build(0)
    uninterrupted = []
    for x, y in data:
        train_step(model, sched, x, y)
        uninterrupted.append(flat(model))

    model, sched = build(0)
    resumed = []
    for x, y in data[:cut]:
        train_step(model, sched, x, y)
        resumed.append(flat(model))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "schedule": sched.state_dict()}, buffer)
    checkpoint = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    model, sched = build(99)  # another init, overwritten by the checkpoint
    model.load_state_dict(checkpoint["model"])
    sched.load_state_dict(checkpoint["schedule"])
    for x, y in data[cut:]:
        train_step(model, sched, x, y)
        resumed.append(flat(model))
    return {"uninterrupted": uninterrupted, "resumed": resumed, "syncs": sched.syncs}


def diloco_job(rank, world_size):
    topk = ("topk", "residual", "allgather", {"compress_ratio": 0.1})
    return {
        "run": schedule_job(rank, world_size, "diloco", topk, {"inner_steps": 2, "fusion_bytes": 0}, 6),
        "resume": resume_job(rank, world_size, topk, {"inner_steps": 2}, 7, 3),
    }


@pytest.mark.fast
def test_diloco_with_topk_and_error_feedback_keeps_ranks_bitwise_identical_and_resumes():
    H, steps = 2, 6
    results = run_ranks(diloco_job, 2)
    runs = [r["run"] for r in results]
    for step in range(steps):
        if (step + 1) % H == 0:
            assert torch.equal(runs[0]["after"][step], runs[1]["after"][step]), step
        else:
            assert not torch.equal(runs[0]["after"][step], runs[1]["after"][step]), step
            assert runs[0]["sent"][step] == (runs[0]["sent"][step - 1] if step else 0)
    assert torch.equal(runs[0]["final"], runs[1]["final"])
    stats = runs[0]["stats"]
    assert stats["syncs"] == steps // H and stats["compression_ratio"] < 0.3  # top 10 % + indices + headers
    assert stats["groups"] == stats["syncs"] * 4  # fusion_bytes=0: one exchange per parameter
    assert any(bool(v.abs().sum()) for v in runs[0]["residuals"].values())  # error feedback on Δ
    for r in results:  # 2 ranks: resumed after step 3 (mid-round) equals uninterrupted, bit for bit
        resume = r["resume"]
        assert all(torch.equal(a, b) for a, b in zip(resume["uninterrupted"], resume["resumed"]))
        assert len(resume["resumed"]) == 7 and resume["syncs"] == 3


# -- (d) resume on one rank ---------------------------------------------------------------


@pytest.mark.parametrize(
    "grace_args",
    [("none", "none", "allreduce", {}), ("topk", "residual", "allgather", {"compress_ratio": 0.1})],
    ids=["none", "topk-residual"],
)
def test_a_resumed_run_continues_bit_for_bit(grace_args):
    out = resume_job(0, 1, (*grace_args[:3], dict(grace_args[3], engine="local")), {"inner_steps": 3}, 8, 4)
    assert all(torch.equal(a, b) for a, b in zip(out["uninterrupted"], out["resumed"]))
    assert len(out["resumed"]) == 8 and out["syncs"] == 2


def test_a_state_of_another_schedule_or_other_settings_is_refused_naming_them():
    model = make_model()
    saved = schedules.create(
        "diloco", torch.optim.SGD(model.parameters(), lr=0.1), local_grace(), model.named_parameters(), inner_steps=3
    )
    train_step(model, saved, *batches(0, 1)[0])
    state = saved.state_dict()

    def fresh(name="diloco", **params):
        return schedules.create(
            name, torch.optim.SGD(model.parameters(), lr=0.1), local_grace(), model.named_parameters(), **params
        )

    with pytest.raises(GraceConfigError, match=r"inner_steps: saved 3, this run 4"):
        fresh(inner_steps=4).load_state_dict(state)
    with pytest.raises(GraceConfigError, match=r"outer_lr: saved 0\.7, this run 0\.5"):
        fresh(inner_steps=3, outer_lr=0.5).load_state_dict(state)
    with pytest.raises(GraceConfigError, match=r"saved by schedule 'diloco'; this one is 'local_sgd'"):
        fresh("local_sgd", inner_steps=3).load_state_dict(state)
    fresh(inner_steps=3, fusion_bytes=0).load_state_dict(state)  # fusion does not change the state
    other = schedules.create(
        "diloco", torch.optim.SGD(model.parameters(), lr=0.1), local_grace("fp16"), model.named_parameters()
    )
    with pytest.raises(GraceConfigError, match=r"saved by compressor 'none'"):
        other.load_state_dict(dict(state, settings=other.settings()))
    with pytest.raises(GraceConfigError, match=r"needs a schedule's state_dict"):
        fresh(inner_steps=3).load_state_dict(state["optimizer"])


# -- (e) bad parameters ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, named",
    [
        ({"inner_steps": 0}, r"inner_steps=0 is out of range; accepted: \[1, inf\]"),
        ({"inner_steps": 2.5}, r"inner_steps=2\.5 must be a number of type int"),
        ({"inner_steps": True}, r"inner_steps=True must be a number"),
        ({"outer_lr": 0}, r"outer_lr=0 is out of range; accepted: \(0, inf\]"),
        ({"outer_lr": float("nan")}, r"outer_lr=nan must be a finite number"),
        ({"outer_momentum": 1.0}, r"outer_momentum=1\.0 is out of range; accepted: \[0, 1\)"),
        ({"outer_momentum": -0.1}, r"outer_momentum=-0\.1 is out of range"),
        ({"nesterov": "yes"}, r"nesterov='yes' must be True or False"),
        ({"outer_momentum": 0.0}, r"nesterov=True needs outer_momentum > 0"),
        ({"fusion_bytes": -1}, r"fusion_bytes=-1 is out of range; accepted: \[0, inf\]"),
        ({"inner_step": 3}, r"unknown parameter 'inner_step' for schedule 'diloco'\. Accepted parameters: inner_steps"),
    ],
)
def test_a_bad_parameter_is_named_with_what_is_accepted(params, named):
    model = make_model()
    with pytest.raises(GraceConfigError, match=named):
        schedules.create("diloco", torch.optim.SGD(model.parameters(), lr=0.1), local_grace(), **params)


def test_an_unknown_schedule_lists_the_valid_ones():
    model = make_model()
    with pytest.raises(GraceConfigError, match=r"unknown schedule 'dilocco'\. Did you mean 'diloco'\? Valid names: "):
        schedules.create("dilocco", torch.optim.SGD(model.parameters(), lr=0.1), local_grace())
    with pytest.raises(GraceConfigError, match=r"Valid names: diloco, local_sgd"):
        schedules.create("fedavg", torch.optim.SGD(model.parameters(), lr=0.1), local_grace())


def test_a_grace_serves_one_wrapper_and_the_optimizer_must_be_one():
    model = make_model()
    grace = local_grace()
    schedules.create("diloco", torch.optim.SGD(model.parameters(), lr=0.1), grace)
    with pytest.raises(GraceConfigError, match=r"build one Grace per way in"):
        schedules.create("diloco", torch.optim.SGD(model.parameters(), lr=0.1), grace)
    with pytest.raises(GraceConfigError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        schedules.create("diloco", list(model.parameters()), local_grace())


# -- (f) stats ------------------------------------------------------------------------------


def test_bytes_per_step_is_bytes_per_sync_over_h():
    H, steps = 4, 8
    model = make_model()
    numel = sum(p.numel() for p in model.parameters())
    sched = schedules.create(
        "local_sgd", torch.optim.SGD(model.parameters(), lr=0.1), local_grace(), model.named_parameters(), inner_steps=H
    )
    for x, y in batches(0, steps):
        train_step(model, sched, x, y)
    stats = sched.stats()
    assert (stats["steps"], stats["syncs"], stats["inner_steps"]) == (steps, 2, H)
    assert stats["bytes_sent"] == 2 * numel * 4
    assert stats["bytes_per_sync"] == numel * 4
    assert stats["bytes_per_step"] == stats["bytes_per_sync"] / H == numel
    sched.reset_stats()
    assert (sched.stats()["bytes_sent"], sched.stats()["steps"], sched.stats()["bytes_per_step"]) == (0, 0, 0.0)
