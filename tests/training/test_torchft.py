"""grace_dgc under torchft (issue 57): replica groups that die, come back and heal.

Each case runs ``examples/train_torchft.py`` as a user does: a lighthouse in the test's child
process, one process per replica group (gloo on the CPU, one rank each), a group killed at a
fixed step (between steps, or inside an exchange: in grace's communication thread) and started
again. Asserted: every group ends on the same parameters bit for bit after the same number of
committed steps (no step applied on some groups only), and the final loss is compared with the
same run without a failure. These start processes of their own (a lighthouse, groups that die
and restart), not kept-up ranks; each is bounded by the script's own timeout and the test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is an optional extra: pip install 'grace_dgc[torchft]'")

from grace_dgc.engines.torchft_engine import TorchFTEngine
from grace_dgc.errors import GraceConfigError

pytestmark = pytest.mark.launches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_torchft.py")


def run(tmp_path, name, *args, expect=0):
    out = tmp_path / name
    env = dict(os.environ, RUST_LOG="warn", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, SCRIPT, "--out", str(out), "--timeout", "150", *args],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    assert done.returncode == expect, done.stdout[-3000:] + done.stderr[-5000:]
    if expect:
        return done.stdout + done.stderr
    groups = sorted(out.glob("group*.json"))
    return [json.loads(path.read_text()) for path in groups], done.stdout


CASES = {
    "2 groups, killed between steps": ["--groups", "2", "--kill", "1:4"],
    "2 groups, killed inside an exchange": ["--groups", "2", "--kill", "1:4:exchange"],
    "3 groups, owner errors (reduce_scatter), killed inside an exchange": [
        *("--groups", "3", "--kill", "0:5:exchange", "--compressor", "qsgd", "--communicator", "reduce_scatter"),
        *("--params", '{"quantum_num": 16, "error_feedback": true}'),
    ],
    "3 groups, PowerSGD's shared Q": [
        *("--groups", "3", "--kill", "2:4", "--compressor", "powersgd", "--communicator", "allreduce"),
        *("--params", '{"compress_rank": 2}'),
    ],
    "2 groups, DiLoCo": ["--groups", "2", "--kill", "1:6", "--way", "diloco", "--steps", "6"],
    # killed mid-round (its 7th step: fragment 0 synchronized at 6, fragment 1's turn at 8): heals at a send
    "2 groups, Streaming DiLoCo": ["--groups", "2", "--kill", "1:7", "--way", "streaming_diloco"],
    "2 groups, 1-bit Adam past its warm-up": ["--groups", "2", "--kill", "1:6", "--way", "onebit_adam"],
    # killed mid-round (its 9th step: the third of a 4-step round of local steps): it heals at the next round start
    "2 groups, 0/1 Adam in its local steps": ["--groups", "2", "--kill", "1:9", "--way", "zero_one_adam"],
    "2 groups, one joins late": ["--groups", "2", "--late", "1"],
}


@pytest.mark.parametrize(
    "case",
    [pytest.param(case, marks=pytest.mark.fast) if "inside an exchange" in case else case for case in CASES],
)
def test_a_lost_group_comes_back_and_every_group_ends_on_the_same_parameters(tmp_path, case):
    args = [*CASES[case], "--restart-after", "1"]
    records, stdout = run(tmp_path, "failed", *args)
    assert "parameters equal on every group" in stdout
    assert len({json.dumps(r["parameters"]) for r in records}) == 1, "bit for bit on every group"
    assert len({r["steps"] for r in records}) == 1, "every group committed the same steps"
    if "--kill" in args:
        assert any("was killed" in line for line in stdout.splitlines())
        killed = int(args[args.index("--kill") + 1].split(":")[0])
        assert records[killed]["healed"] >= 1 and records[killed]["first_step"] > 0, "the restarted group healed"
        if args[args.index("--kill") + 1].endswith("exchange"):  # its peers met the loss in a collective
            assert any(r["discarded"] >= 1 for i, r in enumerate(records) if i != killed), records
    if "--late" in args:
        assert records[1]["healed"] >= 1 and records[1]["first_step"] >= 3, "the late group healed in past step 0"
    if case == "2 groups, killed between steps":  # the same run without a failure
        clean, _ = run(tmp_path, "clean", *CASES[case][:2])
        failed_loss, clean_loss = records[0]["final_loss"], clean[0]["final_loss"]
        # steps trained alone lose the other group's data, the discarded one its batch: close, not equal
        assert failed_loss < 1.5 * clean_loss + 0.05, (failed_loss, clean_loss)
        assert failed_loss < 0.5 * untrained_loss(), "it trained: the loss fell far below the start's"


def test_the_readmes_command_is_a_case_run_here():
    """The README's "Surviving a lost node" command is the case of a kill inside an exchange."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    args = [*CASES["2 groups, killed inside an exchange"], "--restart-after", "1"]
    assert "python examples/train_torchft.py " + " ".join(args) in readme


def untrained_loss():
    """The script's evaluation of either group's initial model (before any heal)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_torchft", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    x, y = script.model_and_data(99, 0)
    losses = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        with torch.no_grad():
            losses.append(float(torch.nn.functional.mse_loss(model(x), y)))
    return min(losses)


def test_a_group_that_rejoins_with_other_settings_is_refused_by_name(tmp_path):
    output = run(
        tmp_path,
        "other",
        *("--groups", "2", "--kill", "1:3", "--restart-after", "1", "--restart-params", '{"compress_ratio": 0.5}'),
        expect=1,
    )
    assert "a group that rejoins must be built as its healthy peers are" in output
    assert "compress_ratio: saved 0.25, this run 0.5" in output


class FakeManager:
    """What TorchFTEngine reads of a Manager, for the refusals (no lighthouse)."""

    def __init__(self, asynchronous=False, group_world_size=1):
        self._use_async_quorum, self._group_world_size = asynchronous, group_world_size

    start_quorum = should_commit = num_participants = report_error = errored = staticmethod(lambda *a: None)


def test_an_asynchronous_quorum_or_a_group_of_several_ranks_is_refused_naming_why():
    with pytest.raises(GraceConfigError, match="use_async_quorum=False"):
        TorchFTEngine(FakeManager(asynchronous=True))
    with pytest.raises(GraceConfigError, match="one rank per replica group"):
        TorchFTEngine(FakeManager(group_world_size=2))
    with pytest.raises(GraceConfigError, match="needs a torchft.Manager"):
        TorchFTEngine(object())


def test_a_grace_on_another_engine_or_streaming_exchanges_that_overlap_are_refused():
    import grace_dgc
    from grace_dgc.training.torchft import fault_tolerant

    model = torch.nn.Linear(4, 2)
    manager = FakeManager()
    local = grace_dgc.build("topk", "residual", "allgather", engine="local", compress_ratio=0.5)
    optimizer = grace_dgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), local)
    with pytest.raises(GraceConfigError, match="engine=grace_dgc.engines.torchft_engine.TorchFTEngine"):
        fault_tolerant(manager, optimizer, model)
    streaming = grace_dgc.schedules.create(
        "streaming_diloco",
        torch.optim.SGD(model.parameters(), lr=0.1),
        grace_dgc.build("none", "none", "allgather", engine=TorchFTEngine(manager)),
        inner_steps=4,
        fragments=2,
        delay=2,
    )
    with pytest.raises(
        GraceConfigError, match=r"delay=2 overlaps .* \(sends 2 inner steps apart\).* delay < inner_steps"
    ):
        fault_tolerant(manager, streaming, model)


class Done:
    def wait(self, *a):
        return True


class OneGroupPG:
    """The process group of a quorum of one (collectives complete at once)."""

    def size(self):
        return 1

    def allgather(self, outs, ins, opts):
        outs[0][0].copy_(ins[0])
        return Done()

    def allreduce(self, tensors, opts):
        return Done()


class ScriptedManager(FakeManager):
    """A quorum of one whose votes are scripted: the commit protocol without a lighthouse."""

    def __init__(self, votes):
        super().__init__()
        self.votes, self._pg, self._quorum_id, self.registered = list(votes), OneGroupPG(), 0, {}
        self.errored = lambda: None

    def start_quorum(self):
        pass

    def num_participants(self):
        return 1

    def participating_rank(self):
        return 0

    def should_commit(self):
        return self.votes.pop(0)

    def register_state_dict_fn(self, key, load, save):
        self.registered[key] = (load, save)


def test_a_discarded_step_leaves_no_trace_so_error_feedback_loses_and_doubles_no_mass():
    """Applied + held = the committed steps' gradients, exactly, across a discarded step: grace's
    residual goes back to what it was when the step began (a residual that kept the discarded
    step's mass would send it later, a step nobody applied)."""
    import grace_dgc
    from grace_dgc.training.torchft import fault_tolerant

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1, bias=False)
    start = model.weight.detach().clone()
    manager = ScriptedManager([True, False, True, True])
    grace = grace_dgc.build("topk", "residual", "allgather", engine=TorchFTEngine(manager), compress_ratio=0.34)
    optimizer = grace_dgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), grace)
    fault_tolerant(manager, optimizer, model)
    assert "grace_dgc" in manager.registered
    gradients = [torch.randn(1, 6) for _ in range(4)]
    held = []
    for gradient in gradients:
        optimizer.zero_grad()
        model.weight.grad = gradient.clone()  # as backward would leave it
        optimizer.step()
        held.append(grace.memory.residuals["param.0"].clone())
    committed = gradients[0] + gradients[2] + gradients[3]
    applied = start - model.weight.detach()
    torch.testing.assert_close(applied + held[-1], committed, rtol=0, atol=1e-6)
    assert torch.equal(held[1], held[0]), "the discarded step's residual is the one before it"


def test_a_step_that_never_began_is_an_error_naming_zero_grad_and_a_second_zero_grad_begins_nothing():
    import grace_dgc
    from grace_dgc.training.torchft import fault_tolerant

    model = torch.nn.Linear(3, 1)
    manager = ScriptedManager([True, True])
    quorums = []
    manager.start_quorum = lambda: quorums.append(1)
    grace = grace_dgc.build("topk", "residual", "allgather", engine=TorchFTEngine(manager), compress_ratio=0.5)
    optimizer = grace_dgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grace)
    fault_tolerant(manager, optimizer, model)
    model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(GraceConfigError, match=r"call zero_grad\(\) before each step's forward pass"):
        optimizer.step()
    optimizer.zero_grad()
    optimizer.zero_grad()  # as some loops do: the step has begun once
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    assert len(quorums) == 1
