"""Checkpoints the way trainers write them: rank 0 saves one file for every rank.

grace's state is per rank (each rank's residuals, momenta, owner errors), while most
training scripts (nanoGPT, the PyTorch examples) save from rank 0 only. The gathered form
puts every rank's :meth:`Grace.state_dict` into rank 0's file; on resume each rank loads
its own part::

    gathered = grace_dgc.gather_state(optimizer)          # every rank (a collective)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "grace": gathered}, path)
    ...
    checkpoint = torch.load(path, weights_only=True) if readable else None
    grace_dgc.load_gathered_state(optimizer, checkpoint["grace"] if checkpoint else None)

``optimizer.state_dict()`` on rank 0 also holds rank 0's own grace state; loading it on
every rank and then :func:`load_gathered_state` gives each rank its own. A rank that cannot
read the file (no shared file system) passes None and receives its part from rank 0.

The bytes move by one ``all_to_all``: rank r's state goes to rank 0 only (a gather), and on
load rank 0 sends each rank its part only (a scatter), never everything to everyone.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from ..errors import GraceConfigError
from ..grace import Grace

FORMAT = "grace_dgc gathered state 1"


def _grace(target: Any) -> Grace:
    grace = target if isinstance(target, Grace) else getattr(target, "grace", None)
    if not isinstance(grace, Grace):
        raise GraceConfigError(
            f"needs a Grace or a DistributedOptimizer / ddp_comm_hook state holding one, got {type(target).__name__}"
        )
    return grace


def _encode(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _decode(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def gather_state(target: Any, root: int = 0) -> dict[str, Any] | None:
    """Every rank's grace state, on ``root`` (None on the other ranks). Collective."""
    grace = _grace(target)
    engine, mine = grace.engine, _encode(grace.state_dict())
    if engine.size == 1:
        return {"format": FORMAT, "world_size": 1, "ranks": [_decode(mine)]}
    device = engine.control_device  # NCCL moves CUDA tensors only
    lengths = [int(n) for n in engine.allgather(torch.tensor([mine.numel()], dtype=torch.int64, device=device))]
    send = [mine.numel() if r == root else 0 for r in range(engine.size)]
    received = engine.all_to_all(mine.to(device), send, lengths if engine.rank == root else [0] * engine.size).cpu()
    if engine.rank != root:
        return None
    return {"format": FORMAT, "world_size": engine.size, "ranks": [_decode(p) for p in received.split(lengths)]}


def load_gathered_state(target: Any, gathered: dict[str, Any] | None, root: int = 0) -> None:
    """Each rank loads its own part of :func:`gather_state`'s output. Ranks that pass None
    receive their part from ``root``, which must pass it. Collective."""
    grace = _grace(target)
    engine = grace.engine
    if gathered is not None:
        if not isinstance(gathered, dict) or gathered.get("format") != FORMAT:
            raise GraceConfigError(
                f"load_gathered_state needs gather_state()'s output (format {FORMAT!r}), got "
                f"{type(gathered).__name__}"
                + (f" with format {gathered.get('format')!r}" if isinstance(gathered, dict) else "")
            )
        if gathered["world_size"] != engine.size:
            raise GraceConfigError(
                f"the gathered state holds {gathered['world_size']} ranks; this run has {engine.size}: "
                "per-rank state (residuals, momenta) does not carry over"
            )
    if engine.size == 1:
        if gathered is None:
            raise GraceConfigError("load_gathered_state on one rank needs the gathered state")
        grace.load_state_dict(gathered["ranks"][0])
        return
    device = engine.control_device
    have = engine.allgather(torch.tensor([gathered is not None], dtype=torch.int64, device=device))
    if all(bool(flag) for flag in have):
        grace.load_state_dict(gathered["ranks"][engine.rank])  # type: ignore[index]
        return
    if not bool(have[root]):
        raise GraceConfigError(f"load_gathered_state: rank {root} (the root) has no gathered state to send")
    parts = [_encode(state) for state in gathered["ranks"]] if engine.rank == root else []  # type: ignore[index]
    sizes = torch.tensor([p.numel() for p in parts] if parts else [0] * engine.size, dtype=torch.int64, device=device)
    sizes = engine.broadcast(sizes, root).cpu()
    send = [int(n) for n in sizes] if engine.rank == root else [0] * engine.size
    recv = [int(sizes[engine.rank]) if r == root else 0 for r in range(engine.size)]
    data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    grace.load_state_dict(_decode(engine.all_to_all(data.to(device), send, recv).cpu()))


class PerRankState:
    """grace's per-rank state as a ``torch.distributed.checkpoint`` (DCP) ``Stateful``::

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, optimizer.optimizer)   # the wrapped optimizer
        dcp.save({"model": model_state, "optim": optim_state, "grace": grace_dgc.PerRankState(optimizer)},
                 checkpoint_id=directory)
        ...
        model_state, optim_state = get_state_dict(model, optimizer.optimizer)
        state = {"model": model_state, "optim": optim_state, "grace": grace_dgc.PerRankState(optimizer)}
        dcp.load(state, checkpoint_id=directory)                                # grace's part loads itself
        set_state_dict(model, optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    Why a wrapper: DCP treats equal keys on different ranks as one replicated value and writes
    it once, but each rank's residuals, momenta and owner errors are its own. Here each rank's
    whole :meth:`Grace.state_dict` is one entry under a key of its own (``rank<r>``), written
    as bytes (its size changes as tensors are first seen, so it cannot be a preallocated
    tensor DCP loads into). The model and the wrapped optimizer's state are the same on every
    rank and go through DCP as usual; ``DistributedOptimizer.state_dict()`` itself would put
    rank-local tensors under shared keys, so it is not what to hand to DCP.

    Loading into another world size: a rank with no entry of its own gets DCP's missing-key
    error; a rank that finds one is refused by :meth:`Grace.load_state_dict` (the saved world
    size differs), as are other methods or settings.
    """

    def __init__(self, target: Any) -> None:
        self.grace = _grace(target)

    def _key(self) -> str:
        return f"rank{self.grace.engine.rank}"

    def state_dict(self) -> dict[str, Any]:
        state = self.grace.state_dict()  # first: binding tells the engine its rank
        return rank_entry(self._key(), state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.grace.load_state_dict(read_rank_entry(state_dict, self._key(), "grace state"))


def rank_entry(key: str, state: Any) -> dict[str, io.BytesIO]:
    """``{key: state as torch.save bytes}``: a rank's own entry for DCP, which writes equal keys
    once and cannot preallocate a value whose size grows as tensors are first seen."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return {key: buffer}


def read_rank_entry(state_dict: dict[str, Any], key: str, what: str) -> Any:
    """The state :func:`rank_entry` wrote under ``key`` (as DCP hands it back: bytes, a
    BytesIO, or already decoded); a missing key is a :class:`GraceConfigError` listing the keys."""
    if key not in state_dict:
        raise GraceConfigError(
            f"the checkpoint holds no {what} for {key} (it has {', '.join(sorted(state_dict)) or 'none'}): "
            "saved on another number of ranks?"
        )
    value = state_dict[key]
    if isinstance(value, io.BytesIO):  # handed over unread
        return torch.load(io.BytesIO(value.getvalue()), weights_only=True)
    if isinstance(value, (bytes, bytearray)):
        return torch.load(io.BytesIO(value), weights_only=True)
    return value
