"""The Horovod engine under a real ``horovodrun -np 2 --gloo`` (stock Horovod 0.28.1).

One horovodrun launch runs tests/hvd_worker.py (every compressor × communicator pair,
the engine's primitives, DistributedOptimizer); the same job runs on gloo through
run_local on the torch engine; the tests compare the two. Horovod is part of the test
install (scripts/install-horovod.sh): if it is missing these tests fail, never skip.
"""

import os
import pickle
import re
import subprocess
import sys

import hvd_worker
import pytest
import torch
from ranks import run_ranks

import grace_dgc
from grace_dgc.registry import COMPRESSORS

try:
    import horovod.torch  # noqa: F401

    HOROVOD_MISSING = None
except ImportError as error:
    HOROVOD_MISSING = (
        f"horovod.torch cannot be imported ({error}); the test install builds it: "
        f"run scripts/install-horovod.sh {sys.executable} (or `make horovod`)"
    )

WORLD = 2
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def start_horovodrun(script, *args, np=WORLD):
    """Start ``script`` under ``horovodrun -np N --gloo`` (stdout/stderr captured)."""
    assert HOROVOD_MISSING is None, HOROVOD_MISSING
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    cmd = [
        HOROVODRUN,
        "-np",
        str(np),
        "--gloo",
        "-H",
        f"localhost:{np}",
        "--gloo-timeout-seconds",
        "60",
        sys.executable,
        script,
        *map(str, args),
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{'horovod': [rank0, rank1], 'torch': [rank0, rank1]} of hvd_worker.engine_job; the
    horovodrun launch and the gloo run overlap (each mostly waits on its startup)."""
    out = tmp_path_factory.mktemp("hvd")
    proc = start_horovodrun(hvd_worker.__file__, out)
    try:
        torch_results = run_ranks(hvd_worker.engine_job, WORLD)
        stdout, stderr = proc.communicate(timeout=240)
    except BaseException:
        proc.kill()
        stdout, stderr = proc.communicate()
        print(f"horovodrun output:\n{stdout[-6000:]}\n{stderr[-6000:]}")
        raise
    assert proc.returncode == 0, f"horovodrun failed ({proc.returncode}):\n{stdout[-6000:]}\n{stderr[-6000:]}"
    hvd_results = []
    for rank in range(WORLD):
        with open(out / f"rank{rank}.pkl", "rb") as fh:
            hvd_results.append(pickle.load(fh))
    return {"horovod": hvd_results, "torch": torch_results}


def test_horovod_is_installed():
    assert HOROVOD_MISSING is None, HOROVOD_MISSING
    import horovod
    import horovod.torch as hvd

    assert horovod.__version__ == "0.28.1" and hvd.gloo_built()


@pytest.mark.launches
def test_every_case_runs_on_both_engines_auto_picking_each(runs):
    listed = {hvd_worker.case_key(*case) for case in hvd_worker.cases()}
    assert "topk+none+allgather" in listed and "none+none+allreduce" in listed and "topk+none+allreduce" not in listed
    for key in (
        "dgc+none+sparse_allreduce",
        "topk+none+sparse_allreduce[global_topk=True]",
        "qsgd+none+reduce_scatter",
        "signsgd+none+reduce_scatter",
        "terngrad+none+hierarchical[group_size=1,outer=reduce_scatter]",
        "topk+residual+hierarchical[group_size=2,outer=sparse_allreduce]",
    ):
        assert key in listed, key
    assert "topk+none+reduce_scatter" not in listed and "qsgd+none+sparse_allreduce" not in listed
    for engine, results in runs.items():
        for rank, result in enumerate(results):
            errors = "\n".join(f"--- {key} ---\n{tb}" for key, tb in result["errors"].items())
            assert not result["errors"], f"{engine} rank {rank}: failing cases:\n{errors}"
            assert set(result["cases"]) == listed, (engine, rank)
            assert result["engine"] == engine  # hvd.init() was called: auto → horovod
            assert {c["engine"] for c in result["cases"].values()} == {engine}


@pytest.mark.launches
def test_ranks_agree_bitwise_on_each_engine(runs):
    for engine, (first, *others) in runs.items():
        for other in others:
            for key, case in first["cases"].items():
                for step, tensors in enumerate(case["steps"]):
                    for name, value in tensors.items():
                        theirs = other["cases"][key]["steps"][step][name]
                        assert torch.equal(value, theirs), (engine, key, step, name)
            assert torch.equal(first["optimizer"]["params"], other["optimizer"]["params"]), engine


def max_engine_difference(runs):
    worst = 0.0
    for hvd_rank, torch_rank in zip(runs["horovod"], runs["torch"]):
        for key, case in hvd_rank["cases"].items():
            for step, tensors in enumerate(case["steps"]):
                for name, value in tensors.items():
                    ref = torch_rank["cases"][key]["steps"][step][name]
                    assert value.shape == ref.shape and value.dtype == ref.dtype, (key, name)
                    assert torch.allclose(value, ref, rtol=1e-5, atol=1e-6), (key, step, name)
                    worst = max(worst, (value - ref).abs().max().item())
    return worst


@pytest.mark.launches
def test_aggregated_gradients_equal_the_torch_engines(runs):
    """Same seed, same method: Horovod and torch.distributed give the same averages."""
    worst = max_engine_difference(runs)
    print(f"max |horovod - torch| over every case, step and tensor: {worst:.3g}")
    assert worst <= 1e-6


@pytest.mark.launches
def test_bytes_sent_follow_each_engines_definition(runs):
    """Horovod: this rank's unpadded contribution (+ int64 size headers); torch: padded to
    the largest rank's. Both recomputed here from the payloads each rank logged."""
    for key in runs["horovod"][0]["cases"]:
        comm = key.rsplit("+", 1)[1].split("[")[0]
        for engine, results in runs.items():
            logs = [r["cases"][key]["payloads"] for r in results]
            for rank, result in enumerate(results):
                measured = result["cases"][key]["bytes"]
                if engine == "horovod" or comm != "allgather":
                    expected = hvd_worker.expected_bytes(logs[rank], comm, engine)
                else:  # each exchange: header + the largest rank's payload bytes
                    expected = sum(
                        8 * len(mine) + max(sum(n * d.itemsize for d, n in p) for p in same)
                        for mine, *same in zip(logs[rank], *logs)
                    )
                # a pre-round (thc's scale) is a collective of its own, not a logged exchange:
                # tests/core/test_thc.py counts those bytes exactly
                if expected is not None and not COMPRESSORS.get(key.split("+", 1)[0]).prerounds:
                    assert measured == expected, (engine, key, rank, measured, expected)
        for rank in range(WORLD):
            assert (
                runs["horovod"][rank]["cases"][key]["bytes"] <= runs["torch"][rank]["cases"][key]["bytes"]
                or comm == "allreduce"
            )  # allreduce: only Horovod's widened bf16 sends more


@pytest.mark.launches
def test_engine_primitives_match_torch(runs):
    for hvd_rank, torch_rank, rank in zip(runs["horovod"], runs["torch"], range(WORLD)):
        hvd_out, torch_out = hvd_rank["primitives"], torch_rank["primitives"]
        for key, value in torch_out.items():
            if key in ("gather_bytes", "bcast_object", "a2a_counted"):
                continue
            got = hvd_out[key]
            pairs = zip(got, value) if isinstance(value, list) else [(got, value)]
            for a, b in pairs:
                assert a.dtype == b.dtype and torch.equal(a, b), (key, a, b)
        assert hvd_out["bcast_object"]["from"] == 1 and torch.equal(hvd_out["bcast_object"]["t"], torch.ones(2))
        # unpadded: (rank+2)·4 + 3·2 (bf16) + 2 (bool); torch pads the first to the longest (3·4)
        assert hvd_out["gather_bytes"] == (rank + 2) * 4 + 6 + 2
        assert torch_out["gather_bytes"] == 3 * 4 + 6 + 2
        # all_to_all: the parts for the other rank out (float32 + bf16), theirs in, unpadded on both
        other = 1 - rank
        assert hvd_out["a2a_counted"] == torch_out["a2a_counted"] == ((rank + other + 1) * 6, (other + rank + 1) * 6)
        start = sum(d + 1 for d in range(rank))  # rank 0 sends d + 1 elements to rank d, in rank order
        assert torch.equal(torch_out["a2a_float"][: rank + 1], torch.arange(start, start + rank + 1.0))
    assert torch.equal(runs["horovod"][0]["primitives"]["sum_int8"], torch.tensor([-56, 56, 14], dtype=torch.int8))


@pytest.mark.launches
def test_distributed_optimizer_works_unchanged_under_horovodrun(runs):
    hvd_opt, torch_opt = runs["horovod"][0]["optimizer"], runs["torch"][0]["optimizer"]
    assert hvd_opt["engine"] == "horovod" and torch_opt["engine"] == "torch"
    assert torch.allclose(hvd_opt["params"], torch_opt["params"], atol=1e-6)
    assert hvd_opt["losses"] == pytest.approx(torch_opt["losses"], abs=1e-6)
    assert 0 < hvd_opt["bytes"] <= torch_opt["bytes"]


def test_engine_errors_name_the_fix(monkeypatch):
    assert HOROVOD_MISSING is None, HOROVOD_MISSING
    from grace_dgc.engines.horovod_engine import HorovodEngine

    assert grace_dgc.create_engine("auto").name != "horovod"  # not initialized here
    with pytest.raises(grace_dgc.GraceConfigError, match=r"call horovod.torch.init\(\) first"):
        HorovodEngine()
    with pytest.raises(grace_dgc.GraceConfigError, match="process_group is accepted only by engine='torch'"):
        HorovodEngine(process_group=object())
    # without Horovod, asking for it says how to install it
    import grace_dgc.engines as engines

    monkeypatch.setitem(sys.modules, "horovod.torch", None)
    monkeypatch.delitem(sys.modules, "grace_dgc.engines.horovod_engine")
    monkeypatch.delattr(engines, "horovod_engine")
    monkeypatch.delitem(engines.ENGINES, "horovod")
    with pytest.raises(ImportError, match=r"pip install grace_dgc\[horovod\].*scripts/install-horovod.sh"):
        grace_dgc.create_engine("horovod")


@pytest.mark.launches
def test_an_error_on_one_rank_ends_the_other_ranks_exchange_at_once():
    """Grace hands a rank's lone error to the engine: Horovod is shut down on that rank, so
    the other's pending collective ends with Horovod's "shut down ... caused by an exception
    on one of the ranks" instead of waiting for the stall check."""
    proc = start_horovodrun(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hvd_failure.py"))
    stdout, stderr = proc.communicate(timeout=180)
    found = re.findall(r"RESULT (\d) (\w+) ([\d.]+)", stdout)
    results = {int(rank): (kind, float(seconds)) for rank, kind, seconds in found}
    assert set(results) == {0, 1}, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    assert results[0][0] == "RuntimeError", results
    assert results[1][0] == "HorovodInternalError" and results[1][1] < 30, results
