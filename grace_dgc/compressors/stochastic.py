"""The base of the stochastic-rounding quantizers: each rank's own seeded random streams."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, ClassVar

import torch

from ..errors import check_range
from .packed import PackedCompressor

if TYPE_CHECKING:
    from ..engines.base import Engine


class StochasticCompressor(PackedCompressor):
    """Base of the stochastic-rounding compressors (qsgd, terngrad, natural): own random streams.

    The t-th compression of tensor ``name`` draws from a fresh ``torch.Generator`` on the
    tensor's device seeded with blake2b(seed + rank, name, t). Hence:
      * the global RNG is never touched, and CUDA tensors get CUDA randoms;
      * ranks round independently (the papers' variance bounds assume independent
        quantisers), yet rank r with ``seed=s`` draws exactly what rank 0 with ``seed=s+r``
        draws — that is how a test reproduces another rank locally;
      * the state is just t per name, equal on all ranks, so loading one rank's
        checkpoint on every rank resumes each rank's own stream exactly.
    The rank is the engine's (Grace binds it; 0 for a compressor used on its own).
    """

    rank = 0
    chunkable = True
    sends_all = True  # a level, ternary or power of two for every element, a rounded 0 included
    SETTINGS: ClassVar[tuple[str, ...]] = ("seed",)
    STATE = ("steps",)
    REPLICATED = ("steps",)  # each tensor's stream position, alike on every rank

    def __init__(self, seed: int = 0) -> None:
        self.seed = check_range("seed", seed, 0, kind=int)
        self.steps: dict[str, int] = {}  # name -> how many times that tensor was compressed

    def generator(self, name: str, device: torch.device | str) -> torch.Generator:
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        key = f"{self.seed + self.rank}\0{name}\0{step}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        return torch.Generator(device=device).manual_seed(seed)

    def bind(self, engine: Engine) -> None:
        """Called by Grace: each rank draws its own stream."""
        self.rank = engine.rank
