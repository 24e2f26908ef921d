"""Where a survey rank runs: its engine (the one source of rank, size, backend and local
rank), its device, and the runner's own small collectives (metrics, agreement)."""

from collections.abc import Sequence
from typing import Any, Self

import torch

import grace_dgc
from grace_dgc.engines import Engine, detect_engine_name


class Context:
    """This rank's runtime: ``engine`` answers rank/size/backend; ``device`` is where it trains."""

    def __init__(self, engine_kind: str, device: torch.device) -> None:
        self.engine_kind = engine_kind  # the runtime's name: "torch", "horovod", "local" (torchft: "torchft")
        self.engine = grace_dgc.create_engine(engine_kind)
        # what grace.build gets: the name (each Grace makes its own group), or under torchft the group's engine
        self.grace_engine: str | Engine = engine_kind
        self.rank, self.size = self.engine.rank, self.engine.size
        self.device = device

    @classmethod
    def detect(cls, device: str = "auto") -> Self:
        """The engine of the runtime this process runs in (Horovod once ``hvd.init()`` was
        called, else an initialised torch.distributed group, else one local process) and a
        device: CUDA for NCCL, the local rank's GPU when CUDA is used."""
        ctx = cls(detect_engine_name(), torch.device("cpu"))
        if ctx.backend == "nccl":
            device = "cuda"
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            index = ctx.engine.local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            device = f"cuda:{index}"
        ctx.device = torch.device(device)
        return ctx

    @property
    def backend(self) -> str:
        return self.engine.backend

    def gather(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's list of floats (float64; on the device for NCCL)."""
        vec = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        if self.size == 1:
            return [vec.cpu().tolist()]
        return [v.cpu().tolist() for v in self.engine.allgather(vec)]

    def sum(self, values: Sequence[float]) -> list[float]:
        vec = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        return (self.engine.allreduce(vec) if self.size > 1 else vec).cpu().tolist()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others' ``obj`` is ignored: often None)."""
        return obj if self.size == 1 else self.engine.broadcast_object(obj, 0)

    def _comm_device(self) -> torch.device | str:
        """NCCL moves CUDA tensors only; gloo and Horovod take these small CPU vectors."""
        return self.device if self.backend == "nccl" else "cpu"

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
