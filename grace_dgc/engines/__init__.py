"""Engines: the one seam between grace_dgc and a distributed runtime.

An engine offers blocking collectives on tensors of the payload's device; it counts the
bytes this rank contributes to each collective. ``auto`` picks, at its first use (a
Grace's first exchange), Horovod when ``hvd.init()`` was called, else torch.distributed
when a process group is initialized, else the single-process ``local`` engine — unless
the environment says this process is one rank of several (``WORLD_SIZE`` > 1, a Horovod
or MPI launch): then it raises instead of training alone without a word.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .. import environment
from ..errors import GraceConfigError, check_range
from .base import Engine
from .local import LocalEngine
from .torch_engine import TorchEngine

ENGINES = {"local": LocalEngine, "torch": TorchEngine}


def _horovod_initialized() -> bool:
    import sys

    hvd = sys.modules.get("horovod.torch")
    try:
        return hvd is not None and hvd.is_initialized()
    except Exception:  # horovod present but its library failed to load
        return False


# Set by the launchers: torchrun (WORLD_SIZE), horovodrun (HOROVOD_SIZE), mpirun (OMPI_…, PMI_…).
LAUNCHER_SIZES = ("WORLD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def detect_engine_name() -> str:
    """The runtime this process runs in: ``horovod``, ``torch`` or ``local`` (raises under a
    launcher that started several ranks when no process group exists yet)."""
    import torch.distributed as dist

    if _horovod_initialized():
        return "horovod"
    if dist.is_available() and dist.is_initialized():
        return "torch"
    sizes = {key: environment.read_int(key) for key in LAUNCHER_SIZES}
    launched = {key: size for key, size in sizes.items() if size is not None and size > 1}
    if launched:
        found = ", ".join(f"{key}={value}" for key, value in launched.items())
        raise GraceConfigError(
            f"engine='auto' found no process group, but the environment says this is one rank of a "
            f"distributed run ({found}): call torch.distributed.init_process_group(...) (or hvd.init()) "
            f"before the first exchange, or pass engine='local' to train this process alone"
        )
    return "local"


class AutoEngine(Engine):
    """``engine="auto"``: the engine it stands for is chosen at its first use, so a part may
    be built before ``init_process_group`` (as GRACE's scripts do). Every call and the
    ``rank``/``size``/``bytes_sent`` attributes go to that engine."""

    def __init__(self, **kwargs: Any) -> None:  # no Engine.__init__: bytes_sent is the chosen engine's
        self._kwargs = kwargs
        self._engine: Engine | None = None

    def resolve(self) -> Engine:
        if self._engine is None:
            name = detect_engine_name()  # process_group and timeout are torch.distributed's
            self._engine = create_engine(name, **(self._kwargs if name == "torch" else {}))
        return self._engine

    @property
    def name(self) -> str:  # type: ignore[override]  # a class attribute elsewhere
        """The chosen engine's name; before the first use, the one it would choose now
        (without choosing: a script may still initialise its process group)."""
        if self._engine is not None:
            return self._engine.name
        try:
            return detect_engine_name()
        except GraceConfigError:
            return "auto"

    rank = property(lambda self: self.resolve().rank)
    size = property(lambda self: self.resolve().size)
    backend = property(lambda self: self.resolve().backend)
    local_rank = property(lambda self: self.resolve().local_rank)
    control_device = property(lambda self: self.resolve().control_device)
    bytes_sent = property(lambda self: 0 if self._engine is None else self._engine.bytes_sent)
    bytes_received = property(lambda self: 0 if self._engine is None else self._engine.bytes_received)
    traffic = property(lambda self: self.resolve().traffic)

    def allreduce(self, tensor: Tensor) -> Tensor:
        return self.resolve().allreduce(tensor)

    def allgather(self, tensor: Tensor, sizes: Sequence[int] | None = None) -> list[Tensor]:
        return self.resolve().allgather(tensor, sizes)

    def broadcast(self, tensor: Tensor, root: int) -> Tensor:
        return self.resolve().broadcast(tensor, root)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.resolve().broadcast_object(obj, root)

    def all_to_all(self, tensor: Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int]) -> Tensor:
        return self.resolve().all_to_all(tensor, send_sizes, recv_sizes)

    def split(self, groups: Sequence[Sequence[int]]) -> Engine | None:
        return self.resolve().split(groups)

    def barrier(self) -> None:
        return self.resolve().barrier()

    def fail(self, error: BaseException) -> None:
        if self._engine is not None:
            self._engine.fail(error)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


def create_engine(engine: str | Engine = "auto", **kwargs: Any) -> Engine:
    """Create an engine by name (``auto``, ``local``, ``torch``, ``horovod``) or pass one
    through; ``auto`` gives an :class:`AutoEngine`, which chooses at its first use."""
    if isinstance(engine, Engine):
        return engine
    if kwargs.get("timeout") is not None:  # checked whatever the engine, not only where it is used
        kwargs["timeout"] = check_range("timeout", kwargs["timeout"], 0, low_open=True)
    if engine == "auto":
        return AutoEngine(**kwargs)
    if engine != "torch":
        kwargs.pop("timeout", None)  # Horovod has its own stall checks; local never waits
    if engine == "horovod" and "horovod" not in ENGINES:
        from . import horovod_engine  # noqa: F401  registers itself; import errors name the fix
    if engine not in ENGINES:
        raise GraceConfigError(
            f"unknown engine {engine!r}; accepted: auto, {', '.join(sorted(set(ENGINES) | {'horovod'}))}"
        )
    return ENGINES[engine](**kwargs)


__all__ = ["AutoEngine", "Engine", "LocalEngine", "TorchEngine", "ENGINES", "create_engine"]
