"""The emulated slow network: the tc commands, the clear error where it is unavailable, and
a real measurement — 1 MB between two gloo ranks over a 10 Mbit/s shaped loopback takes
≈ 0.8 s — plus a one-run survey under --bandwidth. The real checks are skipped (with the
reason) only where the namespace cannot be created, which is found out by trying."""

import json
import os
import sys

import pytest

from grace_survey import cli
from grace_survey.running import netem, runner


def _unavailable_reason():
    try:
        netem.probe(10e6)
    except netem.NetemUnavailable as err:
        return str(err)
    return None


REASON = _unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"shaped network namespace unavailable: {REASON}")


def test_shaping_commands():
    # written out here as words, independently of how netem builds them
    assert netem.shaping_commands(10e6) == [
        ["ip", "link", "set", "lo", "mtu", "1500", "up"],
        "tc qdisc add dev lo root handle 10: tbf rate 10000000bit burst 65536 latency 1s".split(" "),
    ]
    cmds = netem.shaping_commands(1e9, latency_ms=0.1)
    assert cmds[1] == "tc qdisc add dev lo root handle 1: netem delay 0.1ms limit 1000000".split(" ")
    assert cmds[2][5:9] == ["parent", "1:1", "handle", "10:"]
    assert cmds[2][cmds[2].index("burst") + 1] == str(int(1e9 / 8 * 0.002))  # 2 ms of traffic
    assert netem.describe(1e9, 0.1) == "1gbit-0.1ms" and netem.describe() == "local"


def test_missing_tools_give_a_clear_message(monkeypatch):
    monkeypatch.setattr(netem.shutil, "which", lambda tool: None if tool == "tc" else "/usr/bin/" + tool)
    with pytest.raises(netem.NetemUnavailable) as err:
        netem.probe(1e9)
    assert "`tc` (iproute2)" in str(err.value) and "grace-dgc project" in str(err.value)


@needs_netns
def test_one_megabyte_over_10_mbit_takes_about_0_8_s():
    proc = netem.run_shaped(
        [sys.executable, "-m", "grace_survey.running.netem", "measure", "--bytes", "1000000"],
        bandwidth_bps=10e6,
        capture=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shaping"]["bandwidth_bps"] == 10e6
    seconds = result["seconds"][0]
    # 8e6 bits at 1e7 bit/s = 0.8 s (+ headers, − the 64 KiB bucket); unshaped it is milliseconds
    assert 0.5 <= seconds <= 2.0, seconds


@needs_netns
def test_survey_under_bandwidth_runs_in_the_shaped_namespace(tmp_path):
    config = tmp_path / "one.toml"
    config.write_text(
        "workload = 'digits-mlp'\nworkers = 2\nepochs = 1\nmax_steps = 3\n"
        "workload_options = {train_samples = 256, test_samples = 64}\n"
        "[[methods]]\nlabel = 'dense'\ncompressor = 'none'\n"
    )
    out = str(tmp_path / "out")
    assert (
        cli.survey_main(
            ["--config", str(config), "--out", out, "--bandwidth", "50mbit", "--no-progress", "--no-report"]
        )
        == 0
    )
    (summary,) = [r for r in runner.read_records(out) if r["type"] == "summary"]
    assert summary["run_id"] == "dense w2 s0 @50mbit" and summary["network"] == "50mbit"
    assert summary["bandwidth_bps"] == 50e6 and summary["steps"] == 3
    assert summary["bytes_per_step"] == 38440  # dense fp32 gradients of 9,610 parameters
    # the ranks themselves saw the shaping (set in their environment inside the namespace)
    assert summary["shaping"] == {"bandwidth_bps": 50e6, "latency_ms": 0.0, "tag": "50mbit"}
    assert os.environ.get(netem.ENV) is None  # this process stayed outside
