"""A time split that adds up on every path (issue 39): the training thread's wait on the
exchanges is measured where it blocks — DistributedOptimizer's synchronize, the DDP hook's
Futures (DDP waits for them at the end of backward), a schedule's round — so that compute +
wait never exceeds the step, in script mode too, and `grace-dgc project` adds communication
to a compute time that does not already hold it."""

import textwrap
import time

import pytest
import torch
from ranks import run_ranks

import grace_dgc
from grace_dgc import schedules
from grace_survey.config import settings as cfg
from grace_survey.projection import project
from grace_survey.running import runner

STEPS = 6


def split_job(rank, world, path):
    """STEPS steps of a small model on ``path``; returns (wall seconds, grace's wait seconds)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    grace = grace_dgc.build("qsgd", "residual", "allgather")
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    if path == "optimizer":
        opt, net = grace_dgc.DistributedOptimizer(inner, grace, model.named_parameters()), model
    elif path == "hook":
        net = torch.nn.parallel.DistributedDataParallel(model)
        net.register_comm_hook(*grace_dgc.ddp_comm_hook(grace, net))
        opt = inner
    else:
        opt, net = schedules.create("local_sgd", inner, grace, model.named_parameters(), inner_steps=2), model
    generator = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for _ in range(STEPS):
        opt.zero_grad()
        net(torch.randn(32, 64, generator=generator)).square().mean().backward()
        opt.step()
    stats = grace.stats()
    exchanging = sum(stats[f"{phase}_seconds"] for phase in ("compress", "memory", "communicate", "decompress"))
    return time.perf_counter() - start, stats["wait_seconds"], exchanging


@pytest.mark.parametrize("path", ["optimizer", "hook", "schedule"])
def test_the_wait_is_measured_and_within_the_step_on_every_path(path):
    for rank, (wall, wait, exchanging) in enumerate(run_ranks(split_job, 2, (path,), timeout=120)):
        assert 0 < wait <= wall, (path, rank, wait, wall)
        if path != "schedule":
            # one bucket, the step's last: exchanged on the training thread, all of it a wait
            assert wait >= exchanging, (path, rank, wait, exchanging)


HOOK_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist, torch.nn.functional as F
    import grace_dgc
    import grace_survey as survey

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    ddp.register_comm_hook(*grace_dgc.ddp_comm_hook(survey.cell_grace(), ddp))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for epoch in range(2):
        for step in range(8):
            x = torch.randn(16, 64, generator=g)
            opt.zero_grad()
            F.cross_entropy(ddp(x), (x[:, 0] > 0).long()).backward()
            opt.step()
        survey.report_metrics(epoch=epoch + 1, accuracy=0.5, loss=1.0, samples=128)
    dist.destroy_process_group()
    """
)


def test_script_mode_with_the_ddp_hook_splits_its_step_and_project_counts_communication_once(tmp_path):
    script = tmp_path / "train_ddp.py"
    script.write_text(HOOK_SCRIPT)
    method = {"label": "qsgd", "compressor": "qsgd", "memory": "residual", "communicator": "allgather"}
    raw = cfg.script_mode({"workers": 2, "seeds": [0], "methods": [method], "timeout": 120}, str(script))
    summaries, failures = runner.run_grid(cfg.SurveyConfig(raw), str(tmp_path / "out"), progress=False)
    assert not failures, failures
    run = summaries[0]
    assert run["wait_s"] > 0, "the hook's wait was not measured"
    assert run["compute_s"] + run["wait_s"] <= run["step_s"] * (1 + 1e-9), run
    assert run["compute_s"] < run["step_s"]
    # the projection: compute (without the wait) + compress + decompress + the modelled wire
    # time, by hand for allgather on 8 nodes (header and data: 2 allgathers per group)
    nodes, alpha, beta = 8, 1e-4, 1 / 1.25e8
    method = dict(run, rounds=1, measured_communicator="allgather")
    step, comm = project.project_step(method, nodes, alpha, beta)
    groups = run["groups_per_step"]
    wire = 2 * groups * (nodes - 1) * alpha + (nodes - 1) * run["bytes_per_step"] * beta
    decompress = run["decompress_s"] / run["workers"] * nodes
    assert comm == pytest.approx(wire)
    assert step == pytest.approx(run["compute_s"] + run["compress_s"] + decompress + wire)
