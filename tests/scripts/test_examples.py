"""The README's three runnable examples, launched as a user would (torchrun / horovodrun).

Same method, seed and data: DistributedOptimizer under torchrun, the same under
horovodrun and the DDP hook under torchrun print the same losses; the DDP example
resumes from its checkpoint exactly.
"""

import os
import re
import subprocess
import sys
import warnings

import pytest
from conftest import TEARDOWN_ABORT  # torch's gloo teardown abort, after a complete run

from grace_dgc.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
METHOD = [
    "--compressor",
    "topk",
    "--memory",
    "residual",
    "--communicator",
    "allgather",
    "--param",
    "compress_ratio=0.1",
    "--log-every",
    "1",
]


RANKS = 2


def teardown_abort_only(proc):
    """True when the launch failed only in teardown: every rank printed ``rank R done`` (the
    examples' last line, after destroy_process_group) and the only error is the abort above."""
    done = set(re.findall(r"^(?:\[\d+\]<stdout>:)?rank (\d+) done$", proc.stdout, re.M))
    exit_codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr))  # torchrun's failure report
    # the launcher's own traceback (raising ChildFailedError) is the only one allowed
    tracebacks = proc.stderr.count("Traceback (most recent call last)") - proc.stderr.count("ChildFailedError:")
    return (
        done == {str(r) for r in range(RANKS)}
        and TEARDOWN_ABORT in proc.stderr
        # -6: the abort; -15: a rank torchrun stopped (SIGTERM) after another aborted. horovodrun
        # reports no exit codes
        and exit_codes <= {"-6", "-15"}
        and ("-15" not in exit_codes or "-6" in exit_codes)
        and tracebacks <= 0
    )


def launch(cmd, timeout=180):
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout}s:\n{exc.stdout}\n{exc.stderr}") from None
    if proc.returncode and teardown_abort_only(proc):
        warnings.warn(f"{' '.join(cmd)}: every rank finished, then one aborted in teardown", stacklevel=2)
        return proc.stdout
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-5000:]}"
    return proc.stdout


def torchrun(script, *args):
    return launch(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(RANKS),
            "--master_port",
            str(free_port()),
            f"examples/{script}",
            *args,
        ]
    )


def horovodrun(script, *args):
    try:
        import horovod.torch  # noqa: F401
    except ImportError as error:
        raise AssertionError(
            f"horovod.torch cannot be imported ({error}): run scripts/install-horovod.sh {sys.executable}"
        ) from None
    out = launch(
        [
            os.path.join(BIN, "horovodrun"),
            "-np",
            str(RANKS),
            "--gloo",
            "-H",
            f"localhost:{RANKS}",
            "--gloo-timeout-seconds",
            "60",
            sys.executable,
            f"examples/{script}",
            *args,
        ]
    )
    return re.sub(r"^\[\d+\]<stdout>:", "", out, flags=re.M)  # horovodrun's rank prefix


def losses(out):
    return {int(step): float(loss) for step, loss in re.findall(r"^step\s+(\d+)\s+loss (\d+\.\d+)$", out, re.M)}


def check_run(out, engine, steps):
    assert f"engine='{engine}'" in out, out
    got = losses(out)
    assert sorted(got) == list(range(steps)), out
    assert got[steps - 1] < got[0], "training did not reduce the loss"
    ratio = float(re.search(r"ratio: (\d+\.\d+)", out).group(1))
    assert 0 < ratio < 0.5, out  # top-10% values + indices, + headers
    return got


@pytest.fixture(scope="module")
def torchrun_losses():
    return check_run(torchrun("train_torchrun.py", *METHOD, "--steps", "20"), "torch", 20)


@pytest.mark.launches
def test_train_torchrun(torchrun_losses):
    assert torchrun_losses[19] < 0.9 * torchrun_losses[0]


@pytest.mark.launches
def test_train_horovodrun_matches_torchrun(torchrun_losses):
    got = check_run(horovodrun("train_horovodrun.py", *METHOD, "--steps", "20"), "horovod", 20)
    assert got == torchrun_losses


@pytest.mark.launches
def test_train_ddp_matches_and_resumes(torchrun_losses, tmp_path):
    """10 steps saving a checkpoint, then 10 more resuming from it: the losses of the
    uninterrupted DistributedOptimizer run (the hook equals it, and resumes exactly)."""
    checkpoint = str(tmp_path / "ckpt")
    first = torchrun("train_ddp.py", *METHOD, "--steps", "10", "--checkpoint", checkpoint)
    assert "in a DDP hook" in first and "resumed" not in first
    assert check_run(first, "torch", 10) == {s: torchrun_losses[s] for s in range(10)}
    assert sorted(os.listdir(checkpoint)) == ["rank0.pt", "rank1.pt"]  # residuals are per rank
    resumed = torchrun("train_ddp.py", *METHOD, "--steps", "10", "--checkpoint", checkpoint)
    assert "resumed at step 10" in resumed
    assert losses(resumed) == {s: torchrun_losses[s] for s in range(10, 20)}


@pytest.mark.launches
@pytest.mark.parametrize(
    "how",
    [["--checkpoint", "{tmp}/ckpt.pt"], ["--checkpoint", "{tmp}/ckpt.pt", "--rank0-reads"], ["--dcp", "{tmp}/dcp"]],
    ids=["rank0-file", "rank0-file-read-by-rank0-only", "torch-dcp"],
)
def test_train_checkpointed_resumes_exactly(torchrun_losses, tmp_path, how):
    """Rank 0 writes one file (every rank's grace state gathered into it), or DCP writes a
    directory: 10 steps, then 10 resumed, give the uninterrupted run's losses."""
    how = [a.format(tmp=tmp_path) for a in how]
    first = torchrun("train_checkpointed.py", *METHOD, "--steps", "10", *how)
    assert "resumed" not in first and check_run(first, "torch", 10) == {s: torchrun_losses[s] for s in range(10)}
    if how[0] == "--checkpoint":
        assert os.listdir(tmp_path) == ["ckpt.pt"]  # one file, from rank 0
    resumed = torchrun("train_checkpointed.py", *METHOD, "--steps", "10", *how)
    assert "resumed at step 10" in resumed
    assert losses(resumed) == {s: torchrun_losses[s] for s in range(10, 20)}


@pytest.mark.launches
def test_examples_reject_bad_input():
    proc = subprocess.run(
        [sys.executable, "examples/train_torchrun.py", "--param", "compress_ratio"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "expected NAME=VALUE" in proc.stderr


@pytest.mark.launches
@pytest.mark.parametrize(
    ("stdout", "stderr", "tolerated"),
    [
        ("rank 0 done\nrank 1 done\n", f"{TEARDOWN_ABORT}\n  exitcode  : -6 (pid: 1)\n", True),
        # torchrun stops the other rank once one aborted: reported as -15 beside the -6
        (
            "rank 0 done\nrank 1 done\n",
            f"{TEARDOWN_ABORT}\n  exitcode  : -6 (pid: 1)\n  exitcode  : -15 (pid: 2)\n",
            True,
        ),
        ("rank 0 done\nrank 1 done\n", f"{TEARDOWN_ABORT}\n  exitcode  : -15 (pid: 2)\n", False),
        ("[1]<stdout>:rank 1 done\n[0]<stdout>:rank 0 done\n", f"{TEARDOWN_ABORT}\n", True),
        ("rank 0 done\n", f"{TEARDOWN_ABORT}\n  exitcode  : -6 (pid: 1)\n", False),  # rank 1 never finished
        ("rank 0 done\nrank 1 done\n", "  exitcode  : -6 (pid: 1)\n", False),  # another abort
        ("rank 0 done\nrank 1 done\n", f"{TEARDOWN_ABORT}\n  exitcode  : 1 (pid: 1)\n", False),
        ("rank 0 done\nrank 1 done\n", f"Traceback (most recent call last):\nValueError\n{TEARDOWN_ABORT}\n", False),
    ],
)
def test_only_a_teardown_abort_after_every_rank_finished_is_tolerated(stdout, stderr, tolerated):
    proc = subprocess.CompletedProcess([], 1, stdout, stderr)
    assert teardown_abort_only(proc) is tolerated
