"""grace_dgc.compat: GRACE's defaults, keys, names and constructors, and GRACE-idiom scripts
(torch.distributed with explicit ranks, and Horovod) run with only their imports changed."""

import json
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import only_teardown_abort
from test_horovod import HOROVOD_MISSING, start_horovodrun

import grace_dgc
from grace_dgc import compat
from grace_dgc.errors import GraceConfigError
from grace_dgc.launch import free_port


def local(params):
    return compat.grace_from_params({**params, "engine": "local"})


@pytest.mark.parametrize(
    "name, attribute, value",
    [
        ("topk", "compress_ratio", 0.3),
        ("randomk", "compress_ratio", 0.3),
        ("dgc", "compress_ratio", 0.3),
        ("qsgd", "quantum_num", 127),
        ("qsgd", "bucket_size", 128),
        ("qsgd_cuda", "quantum_num", 127),
        ("signum", "momentum", 0.9),
        ("threshold", "threshold", 0.01),
        ("powersgd", "compress_rank", 1),
    ],
)
def test_grace_defaults_not_grace_dgc_defaults(name, attribute, value):
    grace = local({"compressor": name, "memory": "none", "communicator": "allgather"})
    assert getattr(grace.compressor, attribute) == value
    assert (
        grace_dgc.from_params({"compressor": name, "communicator": "allgather", "engine": "local"}).compressor.__dict__[
            attribute
        ]
        == value
    )


def test_grace_memory_defaults_and_keys():
    assert local({"compressor": "efsignsgd", "memory": "efsignsgd", "communicator": "allgather"}).memory.lr == 0.1
    dgc = local({"compressor": "dgc", "memory": "dgc", "communicator": "allgather"})
    assert dgc.memory.registered_name == "momentum" and dgc.memory.momentum == 0.9
    assert dgc.memory.gradient_clipping is None
    clipped = local({"compressor": "dgc", "memory": "dgc", "communicator": "allgather", "gradient_clipping": True})
    assert clipped.memory.gradient_clipping == compat.GRACE_CLIP_NORM
    assert (
        local(
            {"compressor": "dgc", "memory": "dgc", "communicator": "allgather", "gradient_clipping": 0.5}
        ).memory.gradient_clipping
        == 0.5
    )
    assert local({"compressor": "topk", "kernel": "cupy", "communicator": "allgather"}).compressor.compress_ratio == 0.3
    with pytest.raises(GraceConfigError, match="kernel='radix'; accepted: torch, cupy, rdxtopk"):
        local({"compressor": "topk", "kernel": "radix", "communicator": "allgather"})
    with pytest.raises(GraceConfigError, match="gradient_clipping"):
        local({"compressor": "dgc", "memory": "dgc", "gradient_clipping": -1, "communicator": "allgather"})


def test_grace_names_and_communicators():
    assert local({"compressor": "natural_cuda", "communicator": "allgather"}).compressor.registered_name == "natural"
    for compressor in ("qsgd", "terngrad", "topk"):  # GRACE's default allreduce: payloads not summable
        grace = local({"compressor": compressor})
        assert grace.communicator.registered_name == "allgather"
    assert local({"compressor": "fp16"}).communicator.registered_name == "allreduce"
    for compressor in ("qsgd", "terngrad", "natural_cuda"):  # GRACE's alltoall: its reduce-scatter
        grace = local({"compressor": compressor, "communicator": "alltoall"})
        assert grace.communicator.registered_name == "reduce_scatter" and grace.communicator.error_feedback
    assert local({"compressor": "topk", "communicator": "alltoall"}).communicator.registered_name == "allgather"
    with pytest.warns(UserWarning, match="lr=0.1 is not used by compressor 'topk'"):
        local({"compressor": "topk", "communicator": "allgather", "lr": 0.1})
    with pytest.raises(GraceConfigError, match="unknown parameter 'ratio'"):
        local({"compressor": "topk", "communicator": "allgather", "ratio": 0.1})
    with pytest.raises(GraceConfigError, match="unknown communicator 'ring'"):
        local({"communicator": "ring"})


def test_constructors_equal_build():
    torch.manual_seed(0)
    grads = [torch.randn(50, 7) for _ in range(4)]
    pairs = [
        (
            compat.Allgather(compat.TopKCompressor(0.3), compat.ResidualMemory(), 1),
            grace_dgc.build("topk", "residual", "allgather", engine="local", compress_ratio=0.3),
        ),
        (
            compat.Allreduce(compat.QSGDCompressor(), compat.NoneMemory()),
            grace_dgc.build("qsgd", "none", "allgather", engine="local", quantum_num=127, bucket_size=128),
        ),
        (
            compat.Broadcast(compat.DgcCompressor(0.3), compat.DgcMemory(0.9, True, 1), 1),
            grace_dgc.build(
                "dgc",
                "momentum",
                "broadcast",
                engine="local",
                compress_ratio=0.3,
                gradient_clipping=compat.GRACE_CLIP_NORM,
            ),
        ),
        (
            compat.AllToAll(compat.TernGradCompressor(), compat.NoneMemory(), 1),
            grace_dgc.build("terngrad", "none", "reduce_scatter", engine="local"),
        ),
        (
            compat.Allgather(compat.EFSignSGDCompressor(0.1), compat.EFSignSGDMemory(0.1), 1),
            grace_dgc.build("efsignsgd", "efsignsgd", "allgather", engine="local", lr=0.1),
        ),
    ]
    for ported, native in pairs:
        assert ported.world_size == 1
        for g in grads:
            assert torch.equal(ported.step(g.clone(), "w"), native.step(g.clone(), "w")), ported
        assert ported.params["compressor"] == {k: v for k, v in native.params["compressor"].items()}


def test_powersgd_memory_sets_the_rank_and_refuses_foreign_parts():
    compressor = compat.PowerSGDCompressor()
    compat.PowerSGDMemory(compressor.q_memory, 2)
    assert compressor.compress_rank == 2
    with pytest.raises(GraceConfigError, match="PowerSGDCompressor"):
        compat.PowerSGDMemory(object(), 1)
    with pytest.raises(GraceConfigError, match="must be a grace_dgc Compressor"):
        compat.Allgather(object(), compat.NoneMemory(), 1)


def test_declared_world_size_is_checked_at_the_first_exchange():
    grace = compat.Allgather(compat.TopKCompressor(), compat.ResidualMemory(), 2)
    assert grace.world_size == 2  # GRACE scripts read it before init_process_group
    with pytest.raises(GraceConfigError, match="built for world_size=2 but the local engine has 1 ranks"):
        grace.step(torch.ones(4), "w")


# -- GRACE-idiom scripts, written as GRACE's examples are -------------------------------
DIST_SCRIPT = """
import argparse, json
import torch
import torch.distributed as dist
import torch.nn.functional as F
# GRACE: from grace_dl.dist.communicator.allgather import Allgather (and the two below)
from grace_dgc.compat import Allgather, TopKCompressor, ResidualMemory
# GRACE: from grace_dl.dist.helper import grace_from_params
from grace_dgc.compat import grace_from_params

parser = argparse.ArgumentParser()
parser.add_argument('--rank', '-r', type=int, default=0)
parser.add_argument('--world_size', '-w', type=int, default=2)
parser.add_argument('--port', type=int)
parser.add_argument('--helper', action='store_true')
parser.add_argument('--out')
args = parser.parse_args()

grc = Allgather(TopKCompressor(0.3), ResidualMemory(), args.world_size)
if args.helper:
    params = {'compressor': 'topk', 'memory': 'residual', 'communicator': 'allgather'}
    params['world_size'] = args.world_size
    grc = grace_from_params(params)
dist.init_process_group(backend='gloo', init_method=f'tcp://127.0.0.1:{args.port}',
                        world_size=grc.world_size, rank=args.rank)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(100 + args.rank)
x = torch.randn(64, 8, generator=gen)
y = x.sum(1, keepdim=True)
losses, first = [], {}
for step in range(30):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    losses.append(loss.item())
    for index, (name, parameter) in enumerate(model.named_parameters()):
        grad = parameter.grad.data
        if step == 0:
            first[name] = [grad.flatten().tolist()]
        new_tensor = grc.step(grad, name)
        grad.copy_(new_tensor)
        if step == 0:
            first[name].append(grad.flatten().tolist())
    opt.step()
    model.zero_grad()
params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
json.dump({'losses': losses, 'first': first, 'params': params}, open(args.out, 'w'))
"""


def _run_dist(tmp_path, helper):
    script = tmp_path / "grace_dawn_style.py"
    script.write_text(DIST_SCRIPT)
    port = free_port()
    outs = [tmp_path / f"rank{r}-{helper}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                "--rank",
                str(r),
                "--world_size",
                "2",
                "--port",
                str(port),
                "--out",
                str(outs[r]),
            ]
            + (["--helper"] if helper else []),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError("the GRACE-style script did not finish in 120 s") from None
        if only_teardown_abort(proc.returncode, err, finished=_complete_json(outs[procs.index(proc)])):
            warnings.warn("a GRACE-style rank finished, then aborted in torch's gloo teardown", stacklevel=2)
            continue
        assert proc.returncode == 0, err[-3000:]
    return [json.loads(out.read_text()) for out in outs]


def _complete_json(path):
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def _topk_03(values):
    flat = torch.tensor(values)
    k = max(1, int(flat.numel() * 0.3))
    out = torch.zeros_like(flat)
    index = flat.abs().topk(k).indices
    out[index] = flat[index]
    return out


@pytest.mark.launches
def test_grace_dist_script_runs_with_only_its_imports_changed(tmp_path):
    runs = {helper: _run_dist(tmp_path, helper) for helper in (False, True)}
    for ranks in runs.values():
        assert ranks[0]["params"] == ranks[1]["params"]  # ranks stay in sync
        for rank in ranks:
            assert rank["losses"][-1] < 0.5 * rank["losses"][0]
        for name, (raw0, _avg0) in ranks[0]["first"].items():  # step 1: mean of each rank's top 30 %
            raw1 = ranks[1]["first"][name][0]
            expected = (_topk_03(raw0) + _topk_03(raw1)) / 2
            for rank in ranks:
                torch.testing.assert_close(torch.tensor(rank["first"][name][1]), expected, rtol=1e-6, atol=1e-7)
    assert runs[False][0]["params"] == runs[True][0]["params"]  # the helper builds the same thing


HOROVOD_SCRIPT = """
import sys
import torch
import torch.nn.functional as F
# GRACE: import horovod.torch as hvd (GRACE's patched Horovod)
import grace_dgc.compat.horovod as hvd
# GRACE: from grace_dl.torch.helper import grace_from_params
from grace_dgc.compat import grace_from_params

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.5)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
params = {'compressor': 'topk', 'memory': 'residual', 'communicator': 'allgather'}
grc = grace_from_params(params)
optimizer = hvd.DistributedOptimizer(optimizer, grc, named_parameters=model.named_parameters())
gen = torch.Generator().manual_seed(100 + hvd.rank())
x = torch.randn(64, 8, generator=gen)
y = x.sum(1, keepdim=True)
losses = []
for step in range(30):
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    losses.append(hvd.allreduce(loss.detach(), name='loss').item())
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
same = hvd.allgather(flat.unsqueeze(0))
assert torch.equal(same[0], same[1]), 'ranks diverged'
print(f'rank {hvd.rank()} engine {grc.engine.name} ratio {grc.compressor.compress_ratio} '
      f'first {losses[0]:.4f} last {losses[-1]:.4f}', flush=True)
"""


@pytest.mark.launches
def test_grace_horovod_script_runs_with_only_its_imports_changed(tmp_path):
    assert HOROVOD_MISSING is None, HOROVOD_MISSING
    script = tmp_path / "grace_hvd_style.py"
    script.write_text(HOROVOD_SCRIPT)
    proc = start_horovodrun(str(script))
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:] + out[-3000:]
    import re

    lines = re.findall(r"rank (\d) engine (\w+) ratio ([\d.]+) first ([\d.]+) last ([\d.]+)", out)
    assert sorted(line[0] for line in lines) == ["0", "1"], out
    for _, engine, ratio, first, last in lines:
        assert engine == "horovod" and float(ratio) == 0.3
        assert float(last) < 0.5 * float(first)


def test_horovod_optimizer_refuses_horovod_options_with_a_grace():
    assert HOROVOD_MISSING is None, HOROVOD_MISSING
    import grace_dgc.compat.horovod as hvd

    model = torch.nn.Linear(2, 1)
    grace = grace_dgc.build("topk", "residual", "allgather", engine="local")
    with pytest.raises(GraceConfigError, match="num_groups cannot be combined with a Grace"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grace, num_groups=2)
    with pytest.raises(GraceConfigError, match="the second argument must be a Grace"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "topk")
