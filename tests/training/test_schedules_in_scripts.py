"""Schedules (and the DistributedOptimizer) in a user's DDP-shaped script (issue 53): a model
still wrapped in DDP is refused by name, wrapped before or after the schedule was built (DDP's own
allreduce would run beside grace's exchanges, uncounted); a schedule resumed from rank 0's state
on every rank warns on the others (their error feedback is rank 0's); a resume that loaded the
inner optimizer's state and forgot the schedule's warns. 2 gloo ranks."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from ranks import run_ranks

import grace_dgc
from grace_dgc import schedules
from grace_dgc.errors import GraceConfigError


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def wrapper(name, model):
    grace = (
        grace_dgc.build("onebit", "residual", "allgather")
        if "adam" in name
        else grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.5)
    )
    if name == "optimizer":
        return grace_dgc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), grace, model.named_parameters()
        )
    if name == "diloco":
        return schedules.create(
            name, torch.optim.AdamW(model.parameters(), lr=1e-3), grace, model.named_parameters(), inner_steps=2
        )
    params = {"freeze_step": 1} if name == "onebit_adam" else {"var_freeze_step": 1}
    return schedules.create(
        name, torch.optim.Adam(model.parameters(), lr=1e-3), grace, model.named_parameters(), **params
    )


def step(model, opt, rank, seed):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed * 10 + rank))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def ddp_wrapped_job(rank, world, name):
    model = make_model()
    opt = wrapper(name, model)  # nanoGPT's order: the optimizer first, then the DDP wrap
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    try:
        step(ddp, opt, rank, 0)
        return "no error"
    except GraceConfigError as error:
        return str(error)


@pytest.mark.parametrize("name", ["optimizer", "diloco", "onebit_adam", "zero_one_adam"])
def test_a_model_still_wrapped_in_ddp_is_refused_by_name(name):
    for message in run_ranks(ddp_wrapped_job, 2, (name,)):
        assert "DistributedDataParallel" in message and "broadcast_parameters" in message, message


def resume_job(rank, world, name, how):
    model = make_model()
    opt = wrapper(name, model)
    for seed in range(3):
        step(model, opt, rank, seed)
    saved = {"schedule": opt.state_dict(), "inner": opt.optimizer.state_dict(), "model": model.state_dict()}
    rank0 = [saved if rank == 0 else None]
    torch.distributed.broadcast_object_list(rank0, src=0)  # nanoGPT: rank 0's file, read by every rank
    fresh = make_model()
    fresh.load_state_dict(rank0[0]["model"])
    fresh_opt = wrapper(name, fresh)
    if how == "rank 0's schedule state":
        fresh_opt.load_state_dict(rank0[0]["schedule"])
    else:  # the inner optimizer's state only, the schedule's forgotten
        fresh_opt.optimizer.load_state_dict(rank0[0]["inner"])
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("grace_dgc").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(3, 6):
            step(fresh, fresh_opt, rank, seed)
    return [str(w.message) for w in caught if "grace" in str(w.message)] + records


@pytest.mark.parametrize("name", ["zero_one_adam", "diloco"])
def test_a_schedule_resumed_from_rank_0s_state_warns_on_the_other_ranks(name):
    rank0, rank1 = run_ranks(resume_job, 2, (name, "rank 0's schedule state"))
    assert not any("resumed from rank" in m for m in rank0), rank0
    assert any("rank 1 resumed from rank 0's grace state" in m and "gather_state" in m for m in rank1), rank1


def test_a_diloco_resume_that_forgot_the_schedules_state_warns():
    for messages in run_ranks(resume_job, 2, ("diloco", "inner only")):
        assert any("the inner optimizer has state" in m and "schedule's own state_dict()" in m for m in messages), (
            messages
        )


@pytest.mark.launches
def test_the_schedule_script_of_the_docs_runs_and_resumes_bit_for_bit_as_printed(tmp_path):
    """docs/engines.md 'A schedule in a DDP script', launched as a user would (torchrun): the
    run resumed from rank 0's checkpoint at iteration 6 ends where the uninterrupted one does."""
    import pathlib
    import re
    import subprocess
    import sys

    from grace_dgc.launch import free_port

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "engines.md").read_text()
    section = page[page.index("## A schedule in a DDP script") :]
    script = tmp_path / "train_schedule.py"
    script.write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))

    def launch(*args):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        command += ["--master_port", str(free_port()), str(script), *args]
        env = {**__import__("os").environ, "OUT_DIR": str(tmp_path / "out")}
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return sorted(re.findall(r"rank \d+ parameters \w+ bytes \d+", proc.stdout))  # lines may interleave

    whole = launch()
    resumed = launch("resume")
    assert len(whole) == 2 and whole == resumed, (whole, resumed)
    assert whole[0].split()[2] == whole[1].split()[2]  # the ranks hold the same parameters
