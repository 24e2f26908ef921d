"""Streaming DiLoCo (issue 43, item 3) against a reference written here: the fragment
schedule (which parameters each outer step touches, at which step), the τ-delayed application
with mixing, the outer Nesterov step per fragment; the exchange overlapping the next inner
step; ranks bitwise alike on the global parameters; resume bit for bit mid-fragment."""

from __future__ import annotations

import io
import threading

import pytest
import torch
from ranks import run_ranks
from test_distributed import batches

import grace_dgc
from grace_dgc import schedules
from grace_dgc.errors import GraceConfigError


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))


def opt_step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def build(model, compressor="none", communicator="allreduce", engine="local", **params):
    grace = grace_dgc.build(compressor, "none", communicator, engine=engine)
    return schedules.create(
        "streaming_diloco", torch.optim.SGD(model.parameters(), lr=0.1), grace, model.named_parameters(), **params
    )


class Reference:
    """Algorithm 2 by hand, for R ranks' parameter lists with exact averaging: inner SGD;
    after step t, fragments due (sent at t − τ) get θ_global = θ_start − η(Δ̄ + μm), m ← μm + Δ̄,
    θ_start ← θ_global, θ ← lerp(θ_global, θ, α); then fragments whose turn it is send Δ."""

    def __init__(self, thetas, H, P, tau, alpha, eta=0.7, mu=0.9):
        self.thetas, self.H, self.P, self.tau, self.alpha, self.eta, self.mu = thetas, H, P, tau, alpha, eta, mu
        n = len(thetas[0])
        self.fragment = [[i for i in range(n) if i % P == p] for p in range(P)]  # strided
        self.start = [t.clone() for t in thetas[0]]
        self.m = [None] * n
        self.flying = {}  # fragment → (due step, averaged Δ per parameter index)
        self.touched = []  # (step, fragment) of every outer step, in order

    def after_step(self, t):
        for p in sorted(f for f, (due, _) in self.flying.items() if due == t):
            _, delta = self.flying.pop(p)
            for i in self.fragment[p]:
                d = delta[i]
                self.m[i] = d.clone() if self.m[i] is None else self.m[i] * self.mu + d  # torch's SGD buffer
                glob = self.start[i] - self.eta * (d + self.mu * self.m[i])
                self.start[i] = glob.clone()
                for theta in self.thetas:
                    theta[i] = torch.lerp(glob, theta[i], self.alpha) if self.alpha else glob.clone()
            self.touched.append((t, p))
        for p in range(self.P):
            offset = (p + 1) * self.H // self.P
            if t >= offset and (t - offset) % self.H == 0:
                delta = {
                    i: sum(self.start[i] - th[i] for th in self.thetas) / len(self.thetas) for i in self.fragment[p]
                }
                self.flying[p] = (t + self.tau, delta)
                if self.tau == 0:
                    self.after_step_zero(p, t)

    def after_step_zero(self, p, t):
        self.flying[p] = (t, self.flying[p][1])
        saved, self.tau = self.tau, -1  # apply now, without sending again
        self.after_step(t)
        self.tau = saved


@pytest.mark.parametrize("delay, mixing", [(1, 0.5), (2, 0.25), (0, 0.0)])
def test_one_rank_equals_the_reference_fragment_by_fragment(delay, mixing):
    H, P, steps, lr = 4, 3, 14, 0.1
    model = make_model()
    sched = build(model, inner_steps=H, fragments=P, delay=delay, mixing=mixing, fusion_bytes=0)
    assert sched.offsets == [1, 2, 4] and sched.fragment_names()[0] == ["0.weight", "2.bias"]
    twin = make_model()
    ref = Reference([[p.detach().clone() for p in twin.parameters()]], H, P, delay, mixing)
    applied = []
    for step, (x, y) in enumerate(batches(0, steps), start=1):
        syncs = sched.syncs
        opt_step(model, sched, x, y)
        for p, t in zip(twin.parameters(), ref.thetas[0]):  # the inner SGD step, by hand
            p.data.copy_(t)
        twin.zero_grad()
        torch.nn.functional.cross_entropy(twin(x), y).backward()
        ref.thetas[0] = [t - lr * p.grad for t, p in zip(ref.thetas[0], twin.parameters())]
        ref.after_step(step)
        applied += [step] * (sched.syncs - syncs)
        for p, t in zip(model.parameters(), ref.thetas[0]):
            torch.testing.assert_close(p.detach(), t, rtol=1e-5, atol=1e-6)
    assert applied == [t for t, _ in ref.touched]
    # fragment p first applies at t_p + τ, then every H steps
    assert [p for _, p in ref.touched][:3] == [0, 1, 2] and ref.touched[0][0] == 1 + delay


def test_the_exchange_overlaps_the_next_inner_step():
    """The communication thread is held: the send step returns with the fragment in flight,
    the next inner step runs, and only the due step waits for it."""
    model = make_model()
    sched = build(model, inner_steps=4, fragments=2, delay=1)
    sched.grace.always_thread = True  # one rank would exchange inline: nothing to overlap
    data = batches(0, 3)
    opt_step(model, sched, *data[0])  # no fragment's turn at step 1
    gate = threading.Event()
    sched.grace.run_in_order(gate.wait)  # the communication thread now waits for the test
    opt_step(model, sched, *data[1])  # step 2: fragment 0 sends, must not wait for it
    exchange = sched._in_flight[0]
    assert exchange.due == 3 and not any(future.done() for _, future in exchange.pending)
    gate.set()
    opt_step(model, sched, *data[2])  # step 3: due, applied
    assert not sched._in_flight and sched.syncs == 1


def streaming_job(rank: int, world: int) -> dict:
    """fp4 through allgather on 2 ranks: the global θ agrees bitwise after every step, bytes
    move only at send steps; then a run cut mid-flight, saved, resumed, against uninterrupted."""
    H, P, steps = 4, 2, 11

    def run(cut=None):
        model = make_model(0)
        sched = build(model, "fp4", "allgather", "auto", inner_steps=H, fragments=P, delay=2)
        starts, sent = [], []
        data = batches(rank, steps)
        for i, (x, y) in enumerate(data, start=1):
            opt_step(model, sched, x, y)
            starts.append(torch.cat([sched.start[name].reshape(-1) for name, _ in model.named_parameters()]))
            sent.append(sched.syncs)
            if i == cut:
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "schedule": sched.state_dict()}, buffer)
                saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
                assert saved["schedule"]["in_flight"], "the cut should fall while a fragment is in flight"
                model = make_model(7)
                sched = build(model, "fp4", "allgather", "auto", inner_steps=H, fragments=P, delay=2)
                model.load_state_dict(saved["model"])
                sched.load_state_dict(saved["schedule"])
        final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        sched.synchronize_now()
        sent.append(sched.stats()["bytes_sent"])
        synced = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return {"starts": starts, "sent": sent, "final": final, "synced": synced}

    return {"run": run(), "resumed": run(cut=5)}


@pytest.mark.fast
def test_two_ranks_agree_on_the_global_parameters_and_resume_bit_for_bit_mid_flight():
    results = run_ranks(streaming_job, 2)
    runs = [r["run"] for r in results]
    for a, b in zip(runs[0]["starts"], runs[1]["starts"]):
        assert torch.equal(a, b)
    assert not torch.equal(runs[0]["final"], runs[1]["final"])  # the local parts differ
    assert torch.equal(runs[0]["synced"], runs[1]["synced"])  # synchronize_now: one θ everywhere
    *syncs, sent = runs[0]["sent"]
    applied = [i for i in range(1, len(syncs) + 1) if syncs[i - 1] != (syncs[i - 2] if i > 1 else 0)]
    assert applied == [4, 6, 8, 10]  # sent at 2 (fragment 0), 4 (1), 6 (0), 8 (1), 10 (0); τ = 2
    # fp4: ⌈n/2⌉ + 4 bytes per tensor; fragment 0 holds the weights (48, 30, 15 elements), 1 the
    # biases (6, 5, 3); 5 fragment exchanges in the run, then both again in synchronize_now;
    # allgather's size header adds one int64 per payload tensor (3 tensors × 2) per exchange
    weights, biases = (24 + 4) + (15 + 4) + (8 + 4), (3 + 4) + (3 + 4) + (2 + 4)
    assert sent == 4 * weights + 3 * biases + 7 * 6 * 8
    for r in results:
        assert torch.equal(r["run"]["final"], r["resumed"]["final"])
        assert all(torch.equal(a, b) for a, b in zip(r["run"]["starts"], r["resumed"]["starts"]))


def test_bad_settings_are_named():
    model = make_model()
    with pytest.raises(GraceConfigError, match="nothing local to mix"):
        build(model, delay=0, mixing=0.5)
    with pytest.raises(GraceConfigError, match="delay"):
        build(make_model(), inner_steps=4, delay=4)
    with pytest.raises(GraceConfigError, match="pattern"):
        build(make_model(), pattern="random")
    with pytest.raises(GraceConfigError, match="more than the 6 parameters"):
        build(make_model(), inner_steps=10, fragments=7)
