"""The training wing's base (issue 55): every way in derives its state, stats and handshake from its
declarations (grace_dgc.training.driver.Driver). The plugin guide's own schedule runs as printed,
resumes bit for bit and is refused another's state; a Grace serves one way in; a Preset is the
schedule it presets, under its own name."""

from __future__ import annotations

import importlib.util
import io
import re
from pathlib import Path

import pytest
import torch

import grace_dgc
from grace_dgc.errors import GraceConfigError
from grace_dgc.training.schedules import SCHEDULES

ROOT = Path(__file__).resolve().parents[2]


def guide_schedule(tmp_path):
    """plugins/every_other.py as docs/plugins.md prints it, imported (which registers it)."""
    page = (ROOT / "docs" / "plugins.md").read_text()
    source = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "plugins/every_other.py" in b)
    path = tmp_path / "every_other.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("every_other_plugin", path)
    module = importlib.util.module_from_spec(spec)
    snapshot = SCHEDULES.snapshot()
    spec.loader.exec_module(module)
    return module, snapshot


def build(name, **params):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.5)
    schedule = grace_dgc.schedules.create(
        name, torch.optim.SGD(model.parameters(), lr=0.1), grace, model.named_parameters(), **params
    )
    return model, schedule


def train(model, schedule, steps):
    for i in steps:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        schedule.zero_grad()
        model(x).square().mean().backward()
        schedule.step()


def test_the_guides_schedule_runs_as_printed_and_resumes_bit_for_bit(tmp_path):
    module, snapshot = guide_schedule(tmp_path)
    try:
        model, schedule = build("every_other", inner_steps=2)
        train(model, schedule, range(10))  # 5 rounds: averaged, kept, averaged, kept, averaged
        stats = schedule.stats()
        assert (stats["syncs"], stats["kept_rounds"], schedule.kept) == (3, 2, 2)
        assert isinstance(schedule, module.EveryOther)

        cut_model, cut = build("every_other", inner_steps=2)
        train(cut_model, cut, range(5))
        buffer = io.BytesIO()
        torch.save({"model": cut_model.state_dict(), "schedule": cut.state_dict()}, buffer)
        saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        resumed_model, resumed = build("every_other", inner_steps=2)
        resumed_model.load_state_dict(saved["model"])
        resumed.load_state_dict(saved["schedule"])
        train(resumed_model, resumed, range(5, 10))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))
        assert resumed.stats()["kept_rounds"] == 2 and resumed.kept == 2

        _, diloco = build("diloco")
        with pytest.raises(GraceConfigError, match="saved by schedule 'every_other'; this one is 'diloco'"):
            diloco.load_state_dict(saved["schedule"])
        _, other = build("every_other", inner_steps=3)
        with pytest.raises(GraceConfigError, match=r"other settings of schedule 'every_other': inner_steps: saved 2"):
            other.load_state_dict(saved["schedule"])
    finally:
        SCHEDULES.restore(snapshot)


def test_a_grace_serves_one_way_in_whichever_it_is():
    model = torch.nn.Linear(3, 2)
    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.5)
    grace_dgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grace, model.named_parameters())
    with pytest.raises(GraceConfigError, match="already serves DistributedOptimizer; diloco needs one of its own"):
        grace_dgc.schedules.create("diloco", torch.optim.SGD(model.parameters(), lr=0.1), grace)
    with pytest.raises(GraceConfigError, match="already serves DistributedOptimizer; GraceHookState"):
        grace_dgc.ddp_comm_hook(grace, model)


def test_a_preset_is_its_schedule_under_its_own_name_with_its_defaults():
    _, local = build("post_local_sgd")
    assert isinstance(local, grace_dgc.LocalSGD) and not isinstance(local, grace_dgc.DiLoCo)
    assert local.name == "local_sgd" and type(local) is grace_dgc.OuterSync
    assert (local.inner_steps, local.outer_lr, local.outer_momentum, local.nesterov) == (8, 1.0, 0.0, False)
    assert local.state_dict()["schedule"] == "local_sgd"
    assert local.grace.settings()["way_in"]["way"] == "'local_sgd'"
    _, diloco = build("diloco", inner_steps=3)
    with pytest.raises(GraceConfigError, match="saved by schedule 'local_sgd'; this one is 'diloco'"):
        diloco.load_state_dict(local.state_dict())


def test_a_state_of_another_shape_is_refused_before_anything_loads():
    model, schedule = build("diloco", inner_steps=2)
    train(model, schedule, range(3))
    saved = schedule.state_dict()
    torch.manual_seed(0)
    wider = torch.nn.Linear(5, 2)
    other = grace_dgc.schedules.create(
        "diloco",
        torch.optim.SGD(wider.parameters(), lr=0.1),
        grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.5),
        wider.named_parameters(),
        inner_steps=2,
    )
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(GraceConfigError, match=r"differently shaped model: start\['weight'\]: \(2, 4\) for \(2, 5\)"):
        other.load_state_dict(saved)
    assert (
        other.steps == 0 and not other.start and all(torch.equal(before[k], v) for k, v in wider.state_dict().items())
    )


def old_layout(way, state):
    """``state`` as grace_dgc wrote it before the training wing (issue 55): the schedules' format 1
    (the Adam schedules' tensors and policy counters nested, their dense Grace's counters alone),
    the optimizer wrapper's without a header."""
    state = dict(state)
    if way == "wrapper":
        return {"optimizer": state["optimizer"], "grace": state["grace"]}
    state["format"] = 1
    if way == "zero_one_adam":
        state["tensors"] = {key: state.pop(key) for key in ("exp_avg", "exp_avg_sq", "round_starts")}
        state["counters"] = {key: state.pop(key) for key in OLD_ADAM_COUNTERS}
        state["dense_counters"] = state.pop("dense")["counters"]
    return state


OLD_ADAM_COUNTERS = (
    "var_interval",
    "var_counter",
    "var_updates",
    "local_step_interval",
    "local_step_counter",
    "lrs",
    "decays",
    "frozen",
    "since_sync",
)


def built(way):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    if way == "wrapper":
        grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.5, engine="local")
        return model, grace_dgc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), grace, model.named_parameters()
        )
    if way == "zero_one_adam":
        grace = grace_dgc.build("onebit", "residual", "allgather", engine="local")
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        params = {"var_freeze_step": 3, "local_step_scaler": 4}
    else:
        grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.5, engine="local")
        inner, params = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), {"inner_steps": 2}
    return model, grace_dgc.schedules.create(way, inner, grace, model.named_parameters(), **params)


@pytest.mark.parametrize("way", ["wrapper", "diloco", "zero_one_adam"])
def test_a_checkpoint_in_the_layout_before_the_wing_resumes_bit_for_bit(way):
    """The states written before issue 55 load into the new ways in and go on as the uninterrupted
    run does (state_dict -> torch.save -> fresh objects -> load_state_dict)."""
    model, optimizer = built(way)
    train(model, optimizer, range(7))
    cut_model, cut = built(way)
    train(cut_model, cut, range(4))
    buffer = io.BytesIO()
    torch.save({"model": cut_model.state_dict(), "way": old_layout(way, cut.state_dict())}, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    resumed_model, resumed = built(way)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["way"])
    train(resumed_model, resumed, range(4, 7))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))
