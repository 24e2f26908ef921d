"""One set of launch conditions for every method and every launcher (issue 39): the survey's
own ranks, script mode's local ranks, torchrun and horovodrun run each rank with the threads
of one rule (grace_dgc.launch.threads_per_rank), set before torch starts so that threads
started later (grace's communication thread, where PowerSGD multiplies) have them too; every
run records them with the machine's load, and the report warns when they differ."""

import os
import sys
import time

import pytest
from test_script_mode import SCRIPT

from grace_dgc.launch import run_local, threads_per_rank
from grace_survey.config import settings as cfg
from grace_survey.report.conditions import launch_lines
from grace_survey.running import runner
from grace_survey.running.conditions import Neighbours, conditions, launch_record

POWERSGD = [{"label": "powersgd", "compressor": "powersgd", "memory": "powersgd", "communicator": "allreduce"}]
BIN = os.path.dirname(sys.executable)


def _survey(raw, out):
    summaries, failures = runner.run_grid(cfg.SurveyConfig(raw), str(out), progress=False, log=lambda *a: None)
    assert not failures, failures
    return summaries[0]["launch"]


@pytest.mark.launches
def test_powersgd_runs_with_the_same_threads_under_every_launcher(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    script_mode = {"workers": 2, "seeds": [0], "methods": POWERSGD, "timeout": 120}
    launchers = {
        "survey": None,
        "script local": "local",
        "torchrun": f"{BIN}/torchrun --nproc-per-node {{workers}} --master-port {{port}}",
        "horovodrun": f"{BIN}/horovodrun -np {{workers}} -H localhost:{{workers}} --gloo",
    }
    recorded = {}
    for name, launcher in launchers.items():
        out = tmp_path / name.replace(" ", "-")
        if launcher is None:
            raw = {"workload": "digits-mlp", "workers": 2, "epochs": 1, "methods": POWERSGD}
            raw["workload_options"] = {"train_samples": 256, "test_samples": 100}
            recorded[name] = _survey(raw, out)
            continue
        if name == "horovodrun" and not os.path.exists(launcher.split()[0]):
            pytest.skip("Horovod is not installed (make horovod)")
        args = ["horovod"] if name == "horovodrun" else []
        raw = dict(cfg.script_mode(script_mode, str(script)), launcher=launcher, script_args=args)
        recorded[name] = _survey(raw, out)
    expected = [threads_per_rank(2)] * 2
    for name, launch in recorded.items():
        assert launch["threads"] == expected, (name, launch)
        assert launch["threads_other"] == expected, (name, launch)  # the communication thread's too
        assert launch["omp_num_threads"] == str(expected[0]), (name, launch)
        assert launch["load_start"] is not None and 0 <= launch["others_share"] <= 1
    # the survey's own ranks are a pool kept up across its runs (grace_dgc.launch.RankPool)
    assert recorded["script local"]["launcher"] == "script local" and recorded["survey"]["launcher"] == "survey-pool"


def threads_job(rank, world):
    return conditions()


@pytest.mark.launches
def test_run_local_ranks_get_the_rule_before_torch_starts(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's value wins, for every launcher
    for seen in run_local(threads_job, 2, timeout=60):
        assert seen["threads"] == seen["threads_other"] == 2 and seen["omp_num_threads"] == "2"
    monkeypatch.delenv("OMP_NUM_THREADS")
    share = max(1, (os.cpu_count() or 1) // 2)
    for seen in run_local(threads_job, 2, timeout=60):
        assert seen["threads"] == seen["threads_other"] == share


def _run(run_id, threads, others, share):
    launch = {"launcher": "survey", "threads": threads, "threads_other": others, "omp_num_threads": "1"}
    return {"run_id": run_id, "launch": dict(launch, cores=2, load_start=1.2, others_share=share)}


def test_the_report_warns_of_mixed_threads_and_a_busy_machine():
    quiet = launch_lines([_run("a", [1, 1], [1, 1], 0.01), _run("b", [1, 1], [1, 1], 0.2)])
    assert len(quiet) == 1 and "threads per rank 1;" in quiet[0] and "1%–20% of the machine" in quiet[0]
    mixed = launch_lines([_run("a", [1, 1], [1, 1], 0.0), _run("b", [2, 2], [2, 2], 0.0)])
    assert any("not all run with the same threads per rank" in line and "b" in line for line in mixed)
    leaked = launch_lines([_run("a", [1, 1], [2, 2], 0.0)])
    assert any("threads started after set-up" in line for line in leaked)
    busy = launch_lines([_run("a", [1, 1], [1, 1], 0.6)])
    assert any("trained on a busy machine" in line and "a" in line for line in busy)
    assert "not recorded" in launch_lines([{"run_id": "old"}])[0]
    assert launch_record("x", [{"threads": 1, "threads_other": 1}], {"cores": 2}, None)["threads"] == [1]


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.launches
@pytest.mark.alone  # it measures the other processes' share of the machine: there must be none but its own
def test_neighbours_counts_other_processes_not_the_runs_own():
    import multiprocessing

    def alone_share():
        own, alone = time.process_time(), Neighbours()
        spin(0.5)  # this process's own work: not a neighbour's
        return alone.share(time.process_time() - own)

    # the least of three: the machine's other work (a suite beside this one) comes and goes
    assert min(alone_share() for _ in range(3)) < 0.25
    busy = Neighbours()
    spinner = multiprocessing.get_context("spawn").Process(target=spin, args=(1.5,))
    spinner.start()
    spinner.join()
    # one core of the machine's was busy beside this idle process for most of the time
    assert busy.share(0.0) > 0.5 / (os.cpu_count() or 1)
