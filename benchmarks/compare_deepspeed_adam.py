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

What still differs is the compressed allreduce's granularity (README, "Adam"): DeepSpeed pads each
tensor to a multiple of 16 and takes one worker scale per padded tensor, grace_dgc one scale
per owner chunk, unpadded. The printout gives both sides' losses per step and the largest
parameter difference at the end; the warm-up steps agree to fp32 rounding.
"""

import json
import os
import struct
import sys

import torch

import grace_dgc
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


def grace_job(rank, world, schedule):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    grace = grace_dgc.build("efsignsgd", "residual", "reduce_scatter", scale="rms")
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt = grace_dgc.schedules.create(schedule, adam, grace, model.named_parameters(), **SETTINGS[schedule])
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


def main():
    for schedule, path in DATA.items():
        with open(path) as f:
            reference = json.load(f)
        ours = run_local(grace_job, 2, (schedule,))
        print(f"\n{schedule} vs DeepSpeed {reference['deepspeed_version']} ({reference['optimizer']}), 2 gloo ranks")
        print("step  DeepSpeed loss r0/r1        grace_dgc loss r0/r1        |Δ| r0")
        for step in range(STEPS):
            theirs = [reference["ranks"][str(r)]["losses"][step] for r in range(2)]
            mine = [ours[r][0][step] for r in range(2)]
            print(
                f"{step + 1:>4}  {theirs[0]:.6f} / {theirs[1]:.6f}     {mine[0]:.6f} / {mine[1]:.6f}     "
                f"{abs(theirs[0] - mine[0]):.2e}"
            )
        theirs = from_hex(reference["ranks"]["0"]["final_params_hex"])
        mine = ours[0][1]
        print(
            f"final parameters: max |Δ| {float((theirs - mine).abs().max()):.3g} of max |p| "
            f"{float(theirs.abs().max()):.3g}; grace's ranks bitwise equal: {torch.equal(ours[0][1], ours[1][1])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
