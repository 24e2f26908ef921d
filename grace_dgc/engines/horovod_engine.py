"""Horovod engine: Horovod's own collectives (0.28, as released — nothing patched or copied).

Registered as ``engine="horovod"``; ``engine="auto"`` picks it once ``hvd.init()`` was called.
Horovod matches collectives across ranks by *name*, not by order, so every collective is
named ``grace.<kind>.<n>`` with ``n`` counted per engine: ranks issue an engine's
collectives in the same order (Grace runs them one at a time on its communication
thread), so the names agree.

Differences from the torch engine, all on the wire, none in the results:
  * allgather moves each rank's tensor unpadded (Horovod gathers variable sizes along
    dim 0), so ``bytes_sent`` counts this rank's actual tensor, where the torch engine
    counts it padded to the largest rank's;
  * dtypes Horovod cannot carry are moved losslessly: gathered/broadcast as their raw
    bytes (bfloat16, bool), and summed in a wider type (bfloat16 in float32; bool, uint8,
    int8, int16 in int32, cast back with the same wrap-around as a native sum); the widened
    buffer is what Horovod moves, so that is what ``bytes_sent`` counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import GraceConfigError
from .base import Engine

try:
    import horovod.torch as hvd
except ImportError as error:  # not installed, or built without PyTorch support
    raise ImportError(
        "engine='horovod' needs Horovod with PyTorch and Gloo support (horovod.torch could not be "
        f"imported: {error}). Install it with `pip install grace_dgc[horovod]` (horovod==0.28.1) "
        "or, against torch >= 2.1, with the project's scripts/install-horovod.sh, which builds "
        "horovod 0.28.1 with the C++17 flag torch's headers need"
    ) from error

# Types Horovod 0.28's PyTorch ops accept (mpi_lib's horovod_torch_<op>_async_<type> functions).
SUMMABLE = {torch.float16, torch.float32, torch.float64, torch.int32, torch.int64}
MOVABLE = SUMMABLE | {torch.uint8, torch.int8, torch.int16}
# How the other types are summed: in a wider type, then cast back.
WIDER = {
    torch.bfloat16: torch.float32,
    torch.bool: torch.int32,
    torch.uint8: torch.int32,
    torch.int8: torch.int32,
    torch.int16: torch.int32,
}


class HorovodEngine(Engine):
    """Horovod's allreduce (op=Sum) / allgather / broadcast over all ``hvd.size()`` ranks."""

    name = "horovod"

    def __init__(self, process_group: Any = None) -> None:
        super().__init__()
        if process_group is not None:
            raise GraceConfigError(
                "engine='horovod' runs on Horovod's global process set; process_group is "
                "accepted only by engine='torch'"
            )
        if not hvd.is_initialized():
            raise GraceConfigError(
                "engine='horovod' needs Horovod to be initialized: call "
                "horovod.torch.init() first (and launch with horovodrun)"
            )
        self.rank = hvd.rank()
        self.size = hvd.size()
        self._local_rank = hvd.local_rank()
        self._issued = 0  # collectives issued by this engine: the n of their names
        self.process_set = hvd.global_process_set
        self._prefix = "grace"

    def _subset(self, process_set: Any, index: int) -> HorovodEngine:
        """This engine restricted to a Horovod process set (see :meth:`split`)."""
        engine = object.__new__(HorovodEngine)
        engine.__dict__.update(self.__dict__)
        engine.process_set, engine._issued = process_set, 0
        engine.rank, engine.size = process_set.ranks.index(hvd.rank()), len(process_set.ranks)
        engine._prefix = f"{self._prefix}.set{index}"
        return engine

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def fail(self, error: BaseException) -> None:
        """Shut Horovod down on this rank: the other ranks' pending collectives end at once
        with Horovod's "Horovod has been shut down ... caused by an exception on one of the
        ranks" (this rank's error is raised here and printed in its log)."""
        if hvd.is_initialized():
            hvd.shutdown()

    def _name(self, kind: str) -> str:
        self._issued += 1
        return f"{self._prefix}.{kind}.{self._issued - 1}"

    def allreduce(self, tensor: Tensor) -> Tensor:
        if tensor.dtype not in SUMMABLE and tensor.dtype not in WIDER:
            raise GraceConfigError(
                f"engine='horovod' cannot sum {tensor.dtype} tensors; accepted dtypes: "
                f"{', '.join(sorted(str(d) for d in SUMMABLE | set(WIDER)))}"
            )
        wire = tensor.to(WIDER.get(tensor.dtype, tensor.dtype)).contiguous()  # no copy if fit
        self._count(wire)
        hvd.synchronize(
            hvd.allreduce_async_(wire, name=self._name("allreduce"), op=hvd.Sum, process_set=self.process_set)
        )
        if wire is not tensor:  # widened or made contiguous: write the sum back in place
            tensor.copy_(wire.to(tensor.dtype) if tensor.dtype != torch.bool else wire != 0)
        return tensor

    def allgather(self, tensor: Tensor, sizes: Sequence[int] | None = None) -> list[Tensor]:
        scalar = tensor.dim() == 0
        rows = tensor.reshape(1) if scalar else tensor.contiguous()
        if sizes is None and rows.numel() == 0:  # equal sizes promised: every rank is empty
            return [tensor.new_empty(tensor.shape) for _ in range(self.size)]
        if sizes is not None:
            if len(sizes) != self.size or sizes[self.rank] != rows.shape[0]:
                raise GraceConfigError(
                    f"allgather sizes={list(sizes)} must list {self.size} lengths with this rank's "
                    f"({self.rank}) equal to its tensor's {rows.shape[0]}"
                )
            if not any(sizes):  # every rank is empty: no collective, as on the torch engine
                return [tensor.new_empty(0) for _ in range(self.size)]
        wire = rows if rows.dtype in MOVABLE else _as_byte_rows(rows)
        others = (sum(sizes) - rows.shape[0]) if sizes is not None else rows.shape[0] * (self.size - 1)
        # this rank's tensor as it is: Horovod does not pad
        self._count(wire, received=others * (wire.numel() // max(rows.shape[0], 1)))
        gathered = hvd.synchronize(
            hvd.allgather_async(wire, name=self._name("allgather"), process_set=self.process_set)
        )
        if wire is not rows:
            gathered = gathered.view(tensor.dtype).reshape(-1, *rows.shape[1:])
        if sizes is None:  # equal sizes were promised: check, then split evenly
            if gathered.shape[0] != rows.shape[0] * self.size:
                raise GraceConfigError(
                    f"allgather without sizes needs equal lengths on every rank; this rank has "
                    f"{rows.shape[0]} of {gathered.shape[0]} gathered rows: pass sizes="
                )
            sizes = [rows.shape[0]] * self.size
        parts = list(torch.split(gathered, list(sizes)))
        return [p.reshape(()) for p in parts] if scalar else parts

    def broadcast(self, tensor: Tensor, root: int) -> Tensor:
        if not 0 <= root < self.size:
            raise GraceConfigError(f"broadcast root={root} is out of range; accepted: 0..{self.size - 1}")
        rows = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)
        wire = rows if rows.dtype in MOVABLE else rows.view(torch.uint8)  # a view: in place
        self._count(wire if root == self.rank else wire[:0], received=0 if root == self.rank else wire.numel())
        root_rank = root if self.process_set is hvd.global_process_set else self.process_set.ranks[root]
        hvd.synchronize(
            hvd.broadcast_async_(wire, root_rank, name=self._name("broadcast"), process_set=self.process_set)
        )
        if not tensor.is_contiguous():  # rows was a copy
            tensor.copy_(rows.view(tensor.shape))
        return tensor

    def all_to_all(self, tensor: Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int]) -> Tensor:
        self._check_splits(tensor, send_sizes, recv_sizes)
        send, recv = [int(n) for n in send_sizes], [int(n) for n in recv_sizes]
        rows = tensor.contiguous()
        wire = rows if rows.dtype in MOVABLE else rows.view(torch.uint8)
        width = wire.numel() // max(rows.numel(), 1) if rows.numel() else wire.element_size() // rows.element_size()
        self._count(wire[: wire.numel() - send[self.rank] * width], received=(sum(recv) - recv[self.rank]) * width)
        # always a collective (see TorchEngine.all_to_all): a rank that skipped would desync
        splits = torch.tensor([n * width for n in send], dtype=torch.int32)
        handle = hvd.alltoall_async(wire, splits=splits, name=self._name("all_to_all"), process_set=self.process_set)
        out, _ = hvd.synchronize(handle)
        return out if wire is rows else out.view(tensor.dtype)

    def split(self, groups: Sequence[Sequence[int]]) -> Engine | None:
        mine = None
        for index, ranks in enumerate(groups):
            members = tuple(self.process_set.ranks[r] if self.process_set.ranks else r for r in ranks)
            try:
                process_set = _process_set(members)
            except Exception as error:  # static process sets only
                raise GraceConfigError(
                    f"engine='horovod' could not form the process set {members} ({type(error).__name__}: "
                    f"{error}); subgroups (communicator 'hierarchical') need dynamic process sets: run "
                    "with HOROVOD_DYNAMIC_PROCESS_SETS=1 (or hvd.init(process_sets='dynamic'))"
                ) from error
            if self.rank in ranks:
                mine = self._subset(process_set, index)
        return mine

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        root_rank = root if self.process_set is hvd.global_process_set else self.process_set.ranks[root]
        return hvd.broadcast_object(
            obj, root_rank=root_rank, name=self._name("broadcast_object"), process_set=self.process_set
        )

    def barrier(self) -> None:
        hvd.barrier(process_set=self.process_set)


_PROCESS_SETS: dict[tuple[int, ...], Any] = {}  # members -> the process set made for them


def _process_set(members: tuple[int, ...]) -> Any:
    """The Horovod process set of these global ranks: the global one, one made before (Horovod
    refuses a duplicate, and every Grace built with ``hierarchical`` asks again), or a new
    one (collective: every rank asks for the same sets in the same order)."""
    if list(members) == list(range(hvd.size())):
        return hvd.global_process_set
    if members not in _PROCESS_SETS:
        _PROCESS_SETS[members] = hvd.add_process_set(list(members))
    return _PROCESS_SETS[members]


def _as_byte_rows(rows: Tensor) -> Tensor:
    """``rows`` (dim 0 = rows) reinterpreted as uint8 rows of the same count: lossless."""
    return rows.reshape(rows.shape[0], math.prod(rows.shape[1:])).view(torch.uint8)


from . import ENGINES  # noqa: E402  (the package imports this module lazily)

ENGINES["horovod"] = HorovodEngine
