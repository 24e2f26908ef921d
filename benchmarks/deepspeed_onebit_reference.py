"""Reference trajectories from DeepSpeed's own 1-bit Adam / 0/1 Adam on CPU (2 gloo ranks).

NOT part of grace_dgc and NOT runnable in the project venv: it needs a separate venv with
DeepSpeed. Its output is a fixed reference for comparing grace_dgc's implementations with.

DeepSpeed version: 0.19.6 (the newest PyPI release that still ships
``deepspeed/runtime/fp16/onebit/``; 0.19.7 and 0.19.8 dropped the 1-bit optimizers and
``runtime/comm/{compressed,nccl,mpi}.py``). Torch: 2.13.0+cpu.

Install (separate venv, does not touch the project's .venv)::

    python3.11 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed==0.19.6 numpy

Launch (2 ranks, gloo, CPU accelerator)::

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/torchrun --nproc_per_node 2 --master_port 29612 \
        benchmarks/deepspeed_onebit_reference.py --opt onebit  > onebit.txt
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/torchrun --nproc_per_node 2 --master_port 29613 \
        benchmarks/deepspeed_onebit_reference.py --opt zoadam  > zoadam.txt

Rank 0 prints one line ``RESULT_JSON {...}``. ``--per-step-params`` also records each rank's
flattened parameters after every step.

Backend and the two shims
-------------------------
Stock DeepSpeed cannot run these optimizers on a CPU:
  * comm_backend_name='nccl' and 'mpi' import ``cupy`` (and 'mpi' also ``mpi4py``). They pass
    tensors to cupy through DLPack and call ``cupy.cuda.Device(local_rank).use()``, so they
    need CUDA.
  * 'hccl' imports ``torch_npu`` (Ascend).
  * 'compressed' (torch.distributed collectives, so it works with gloo) loads
    ``PackbitsBuilder``. That op exists only for XPU (SYCL, csrc/xpu/packbits/packing.cpp).
    With DS_ACCELERATOR=cpu it resolves to NotImplementedBuilder, and ``.load()`` raises
    ``ValueError: This op had not been implemented on CPU backend.``
  * Even with packbits available, 'compressed' fails under gloo:
    ``dist.all_gather(recvbuf_scale, worker_scale)`` gathers a 0-dim scale into shape-(1,)
    buffers, and gloo raises ``ProcessGroupGloo::allgather: invalid tensor size at index 0
    (expected (), got (1))``. NCCL only checks numel.

This script uses comm_backend_name='compressed' and goes through ``deepspeed.initialize``.
So the DeepSpeed engine does the warm-up gradient all-reduce (average) and honours the
optimizer's ``enable_backward_allreduce`` toggles. There are exactly two shims, both confined
to the module ``deepspeed.runtime.comm.compressed``:
  1. its ``dist`` is wrapped so that ``all_gather`` reshapes the 0-dim scale to (1,); values
     are unchanged;
  2. its ``PackbitsBuilder`` is swapped for ``_CpuPackbitsBuilder`` below, a pure-torch port
     of packing.cpp with the same semantics:
  * packbits: bit = !signbit(x), MSB first, 8 floats per byte, bits past input_size are 0.
    So +0.0 packs as +1 and -0.0 packs as -1.
  * unpackbits: bit 1 -> +1.0, bit 0 -> -1.0, output length 8 * n_bytes.
Everything else (optimizer step, CompressedBackend.compressed_allreduce, engine) is
DeepSpeed 0.19.6's own code.

Problem: torch.manual_seed(0); Linear(64, 8) fp32; 2 ranks. At step s (1-based), rank r
uses torch.Generator().manual_seed(1000*s + r) for x = randn(16, 64) then y = randn(16, 8).
MSE loss; 12 steps; lr=1e-2; "gradient_clipping": 0.0 (set explicitly because DeepSpeed
0.19.6 defaults to clipping at global norm 1.0); fp32 only (no fp16/bf16, no ZeRO).
  onebit: OnebitAdam(freeze_step=5)
  zoadam: ZeroOneAdam(var_freeze_step=6, var_update_scaler=2, local_step_scaler=4,
          local_step_clipper=4)
Recorded per step: each rank's loss (before its update) and the engine's
enable_backward_allreduce flag in effect for that step's gradients. After the last step:
each rank's flattened parameters (weight.flatten() then bias), given as float32 hex bit
patterns and as floats.
"""

import argparse
import json
import os
import struct

import torch


class _CpuPacker:
    """Pure-torch equivalent of DeepSpeed's XPU packbits/unpackbits kernels."""

    _weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)

    def packbits(self, tensor, input_size, rank):
        t = tensor.reshape(-1)[:input_size].float()
        bits = (~torch.signbit(t)).to(torch.uint8)
        packed_size = (input_size + 7) // 8
        pad = packed_size * 8 - input_size
        if pad:
            bits = torch.cat([bits, torch.zeros(pad, dtype=torch.uint8)])
        return (bits.view(packed_size, 8) * self._weights).sum(dim=1, dtype=torch.uint8)

    def unpackbits(self, tensor, input_size, rank):
        b = tensor.reshape(-1)[:input_size].to(torch.uint8)
        bits = (b.unsqueeze(1) & self._weights).ne(0).reshape(-1)
        return (bits.float() - 0.5) * 2


class _CpuPackbitsBuilder:
    def load(self):
        return _CpuPacker()


class _GlooDistProxy:
    """Forwards to deepspeed.comm; all_gather reshapes a 0-dim input to the receive-buffer
    shape (1,). NCCL accepts the mismatch (only numel matters), gloo raises
    'ProcessGroupGloo::allgather: invalid tensor size'. Values are unchanged."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def all_gather(self, tensor_list, tensor, *args, **kwargs):
        if tensor.shape != tensor_list[0].shape and tensor.numel() == tensor_list[0].numel():
            tensor = tensor.reshape(tensor_list[0].shape)
        return self._real.all_gather(tensor_list, tensor, *args, **kwargs)


def _install_shim():
    import deepspeed.runtime.comm.compressed as compressed

    compressed.PackbitsBuilder = _CpuPackbitsBuilder
    compressed.dist = _GlooDistProxy(compressed.dist)


def _hex(t):
    return [struct.pack(">f", v).hex() for v in t.tolist()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--opt", choices=["onebit", "zoadam"], default="onebit")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--per-step-params", action="store_true")
    args = ap.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm as dist

    _install_shim()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    if args.opt == "onebit":
        opt_cfg = {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 5, "comm_backend_name": "compressed"}}
    else:
        opt_cfg = {
            "type": "ZeroOneAdam",
            "params": {
                "lr": 1e-2,
                "var_freeze_step": 6,
                "var_update_scaler": 2,
                "local_step_scaler": 4,
                "local_step_clipper": 4,
                "comm_backend_name": "compressed",
            },
        }
    cfg = {
        "train_batch_size": 16 * world,
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "optimizer": opt_cfg,
        # DeepSpeed 0.19.6 defaults gradient_clipping to 1.0; the reference problem has none.
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    losses, flags, per_step = [], [], []
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 64, generator=g)
        y = torch.randn(16, 8, generator=g)
        flags.append(bool(engine.enable_backward_allreduce))
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if args.per_step_params:
            per_step.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mine = {"losses": losses, "allreduce_flags": flags, "final_params": flat.tolist(), "final_params_hex": _hex(flat)}
    if args.per_step_params:
        mine["per_step_params"] = per_step
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    if rank == 0:
        import deepspeed as _ds

        out = {
            "deepspeed_version": _ds.__version__,
            "torch_version": torch.__version__,
            "optimizer": args.opt,
            "comm_backend_name": "compressed(+cpu packbits shim)",
            "world_size": world,
            "steps": args.steps,
            "ranks": {str(r): gathered[r] for r in range(world)},
        }
        print("RESULT_JSON " + json.dumps(out), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
