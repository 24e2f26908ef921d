"""grace_dgc's 1-bit Adam and 0/1 Adam side by side with DeepSpeed 0.19.6's own, on its reference problem.

    .venv/bin/python benchmarks/compare_deepspeed_adam.py

The DeepSpeed side was run once with ``benchmarks/deepspeed_onebit_reference.py`` (a separate
venv with DeepSpeed 0.19.6, 2 gloo ranks on a CPU, its ``compressed`` backend with two
documented shims: DeepSpeed's 1-bit optimizers need CUDA/cupy, MPI or an XPU op otherwise)
and its losses and final parameters (fp32 hex) are kept in ``benchmarks/data/``. This script
trains grace_dgc's schedules on the same problem (``Linear(64, 8)`` from ``torch.manual_seed(0)``,
rank r's batch of step s drawn from ``manual_seed(1000·s + r)``, MSE, lr 1e-2, 12 steps, 2 gloo
ranks) with DeepSpeed's conventions where they are settings:

* DeepSpeed's first ``step()`` only allocates its buffers (no update) yet counts as step 1 of
  its policies: grace's schedule starts with ``steps = 1`` and the first batch is not stepped;
* no bias correction, no momentum mask (none given to DeepSpeed), no clipping;
* 1-bit Adam ``freeze_step`` 5 on both sides (dense at steps 2-5); 0/1 Adam ``var_freeze_step``
  7 here for DeepSpeed's 6 (DeepSpeed freezes at the end of the step after ``var_freeze_step``).

Two runs per method. ``grace_dgc`` is the papers' composition as grace_dgc builds it
(efsignsgd(rms) + residual + reduce_scatter), which differs from DeepSpeed in the compressed
allreduce's granularity (docs/methods.md, "Adam"): DeepSpeed pads each tensor to a multiple of 16 and takes
one worker scale per padded tensor, grace_dgc one per owner chunk. ``+ DeepSpeed's allreduce``
runs the same schedule with DeepSpeed's compressed allreduce written here as a plugin
communicator (``none`` compressor, ``none`` memory: the communicator keeps the worker and server
errors, as DeepSpeed's backend does): what remains is the schedules' own arithmetic. The
printout gives the losses per step and the largest parameter difference at the end.
"""

import json
import os
import struct
import sys

import numpy as np
import torch

import grace_dgc
from grace_dgc.interfaces import Communicator
from grace_dgc.launch import run_local

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = {
    "onebit_adam": os.path.join(HERE, "data", "deepspeed-0.19.6-onebit-adam.json"),
    "zero_one_adam": os.path.join(HERE, "data", "deepspeed-0.19.6-zero-one-adam.json"),
}
SETTINGS = {
    "onebit_adam": {"freeze_step": 5, "bias_correction": False, "momentum_mask": False},
    "zero_one_adam": {
        "var_freeze_step": 7,
        "var_update_scaler": 2,
        "local_step_scaler": 4,
        "local_step_clipper": 4,
        "bias_correction": False,
        "momentum_mask": False,
    },
}
STEPS = 12
COMPOSITIONS = {
    "grace_dgc": ("efsignsgd", "residual", "reduce_scatter", {"scale": "rms"}),
    "+ DeepSpeed's allreduce": ("none", "none", "deepspeed_compressed", {}),
}


def _sign(x):
    """DeepSpeed's sign for the errors: +1 where x ≥ 0 (both zeros), else −1."""
    return x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)


@grace_dgc.register_communicator("deepspeed_compressed")
class DeepSpeedCompressed(Communicator):
    """DeepSpeed 0.19.6's ``CompressedBackend.compressed_allreduce``, its arithmetic step by step
    (signs travel as ±1 floats here: bytes do not matter for the comparison)."""

    STATE = ("worker_errors", "server_errors")

    def __init__(self, engine):
        super().__init__(engine)
        self.worker_errors, self.server_errors = {}, {}

    def aggregate_into(self, comp, payloads, ctxs, names, outs, consume=False):
        n, me = self.engine.size, self.engine.rank
        divider = int(n * 8 / np.gcd(n, 8))
        for payload, name, out in zip(payloads, names, outs):
            flat = payload[0].reshape(-1).float()
            size = flat.numel() + (-flat.numel()) % (n * divider)
            buffer = torch.cat([flat, torch.zeros(size - flat.numel())])
            buffer.add_(self.worker_errors.setdefault(name, torch.zeros(size)))
            worker_scale = torch.linalg.norm(buffer) / np.sqrt(torch.numel(buffer))
            self.worker_errors[name] = buffer - worker_scale * _sign(buffer.clone())
            signs = torch.where(torch.signbit(buffer), -1.0, 1.0)  # packbits: bit = !signbit
            chunk = size // n
            received = torch.stack([s[me * chunk : (me + 1) * chunk] for s in self.engine.allgather(signs)])
            scales = torch.stack(self.engine.allgather(worker_scale.reshape(1)))
            server = received.mul_(scales.mul_(1 / n)).sum(0)
            server.add_(self.server_errors.setdefault(name, torch.zeros(chunk)))
            server_scale = torch.linalg.norm(server) / np.sqrt(server.numel())
            self.server_errors[name] = server - server_scale * _sign(server.clone())
            server_signs = torch.where(torch.signbit(server), -1.0, 1.0)
            gathered = torch.stack(self.engine.allgather(server_signs))
            result = gathered.mul_(torch.stack(self.engine.allgather(server_scale.reshape(1)))).flatten()
            out.copy_(result[: flat.numel()].view(out.shape)).mul_(n)  # Grace divides by n (exact for 2)
        return payloads, ctxs


def grace_job(rank, world, schedule, composition):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    compressor, memory, communicator, params = COMPOSITIONS[composition]
    grace = grace_dgc.build(compressor, memory, communicator, **params)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    # fusion_bytes=0: DeepSpeed compresses parameter by parameter (a fused bucket would share one scale)
    opt = grace_dgc.schedules.create(
        schedule, adam, grace, model.named_parameters(), fusion_bytes=0, **SETTINGS[schedule]
    )
    opt.steps = 1  # DeepSpeed's first step() allocates and counts, but does not update
    losses = []
    for step in range(1, STEPS + 1):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 64, generator=generator), torch.randn(16, 8, generator=generator)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step > 1:
            opt.step()
        losses.append(loss.item())
    opt.synchronize_now()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return losses, flat


def from_hex(words):
    return torch.tensor([struct.unpack(">f", bytes.fromhex(w))[0] for w in words])


def main(argv=None):
    """``--check``: exit 1 unless 1-bit Adam and 0/1 Adam with DeepSpeed's allreduce are within
    1e-6 of DeepSpeed's recorded parameters (a test runs this). 1-bit Adam is bit for bit where
    the trajectories were recorded; on another CPU its float32 norms round differently in the last
    bits (5.96e-7 at |p| ≤ 0.544 on an AVX-512 machine, with every ATEN_CPU_CAPABILITY and one
    thread), so exactness is printed, not required."""
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    failures = []
    for schedule, path in DATA.items():
        with open(path) as f:
            reference = json.load(f)
        runs = {name: run_local(grace_job, 2, (schedule, name)) for name in COMPOSITIONS}
        print(f"\n{schedule} vs DeepSpeed {reference['deepspeed_version']} ({reference['optimizer']}), 2 gloo ranks")
        print("step  DeepSpeed loss (rank 0)  " + "  ".join(f"{name:>24} |Δ|" for name in runs))
        for step in range(STEPS):
            theirs = reference["ranks"]["0"]["losses"][step]
            row = "  ".join(f"{ours[0][0][step]:>24.6f} {abs(theirs - ours[0][0][step]):.0e}" for ours in runs.values())
            print(f"{step + 1:>4}  {theirs:>23.6f}  {row}")
        theirs = from_hex(reference["ranks"]["0"]["final_params_hex"])
        for name, ours in runs.items():
            print(
                f"{name}: final parameters max |Δ| {float((theirs - ours[0][1]).abs().max()):.3g} "
                f"(max |p| {float(theirs.abs().max()):.3g}); ranks bitwise equal: {torch.equal(ours[0][1], ours[1][1])}"
            )
        exact = runs["+ DeepSpeed's allreduce"][0][1]
        print(f"+ DeepSpeed's allreduce bit for bit: {torch.equal(exact, theirs)}")
        if not torch.allclose(exact, theirs, rtol=0, atol=1e-6):
            failures.append(schedule)
    if check and failures:
        print(f"FAILED: {', '.join(failures)} with DeepSpeed's allreduce does not match DeepSpeed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
