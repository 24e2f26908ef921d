"""Engines: the one seam between grace_dgc and a distributed runtime.

An engine offers blocking collectives on tensors of the payload's device; it counts the
bytes this rank contributes to each collective. ``auto`` picks Horovod when
``hvd.init()`` was called, else torch.distributed when a process group is initialized,
else the single-process ``local`` engine.
"""
from ..errors import GraceConfigError
from .base import Engine
from .local import LocalEngine
from .torch_engine import TorchEngine

ENGINES = {"local": LocalEngine, "torch": TorchEngine}


def _horovod_initialized():
    import sys
    hvd = sys.modules.get("horovod.torch")
    try:
        return hvd is not None and hvd.is_initialized()
    except Exception:   # horovod present but its library failed to load
        return False


def create_engine(engine="auto", **kwargs):
    """Create an engine by name (``auto``, ``local``, ``torch``, ``horovod``) or pass one through."""
    if isinstance(engine, Engine):
        return engine
    if engine == "auto":
        import torch.distributed as dist
        if _horovod_initialized():      # registers on first import, below
            engine = "horovod"
        elif dist.is_available() and dist.is_initialized():
            engine = "torch"
        else:
            engine = "local"
    if engine == "horovod" and "horovod" not in ENGINES:
        from . import horovod_engine  # noqa: F401  registers itself; import errors name the fix
    if engine not in ENGINES:
        raise GraceConfigError(f"unknown engine {engine!r}; accepted: auto, {', '.join(sorted(ENGINES))}")
    return ENGINES[engine](**kwargs)


__all__ = ["Engine", "LocalEngine", "TorchEngine", "ENGINES", "create_engine"]
