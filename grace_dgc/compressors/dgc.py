import math
import random
from typing import Any

import torch
from torch import Tensor

from ..errors import GraceConfigError, check_bool, check_range
from ..interfaces import Payload
from ..registry import register_compressor
from .sparse import SparseCompressor, SparseContext, at_least, sparse_payload


@register_compressor("dgc")
class DGCCompressor(SparseCompressor):
    """Deep Gradient Compression's sparsifier (Lin et al. 2018, arXiv 1712.01887).

    Threshold by sampling, for ``n`` elements, kept ratio ``r`` and ``k = max(1, ⌊r·n⌋)``:

        stride = odd(⌊n / max(⌈sample_ratio·n⌉, ⌈2n/k⌉)⌋),   start ~ U{0..stride-1}
        S = |g|[start::stride],   τ = min top_⌈|S|·k/n⌉(S)              (estimate)
        C = { i : |g_i| ≥ τ·decay^j }, j = 0, 1, …, max_adaptation_iters  (first with |C| ≥ k)
        sent = C                       if k ≤ |C| ≤ ⌊13k/10⌋
             = argtop_k |g_C|          if |C| > ⌊13k/10⌋      (hierarchical selection)
             = argtop_k |g|            if every j left |C| < k (exact fallback)

    so a sparsified tensor always sends between k and ⌊13k/10⌋ elements (exactly k when
    stride ≤ 1, i.e. tensors too small to sample). Payload: values (the tensor's dtype, or
    fp16 with ``fp16_values``) + int32 indices, as top-k's; sizes differ between ranks, so
    it needs allgather or broadcast.

    Warm-up (sparsity rises exponentially), position p = epoch (``grace.set_epoch``) or,
    with ``warmup_steps``, the number of earlier compress calls of that tensor; P = length:

        r_p = warmup_ratios[⌊p·len/P⌋]                  if warmup_ratios is given
            = max(warmup_coeff^(p+1), compress_ratio)   if warmup_coeff is given
            = compress_ratio^((p+1)/P)                   otherwise,   for p < P;
        r_p = compress_ratio                             for p ≥ P.

    The paper's 75%, 93.75%, 98.4375%, 99.6%, 99.9% sparsity is exactly warmup_epochs=5,
    warmup_coeff=0.25 (kept 4^-(e+1), floored at 0.001); the default coefficient gives
    74.9%, 93.7%, 98.4%, 99.6%, 99.9%.

    Dense rule: tensors with fewer than ``min_compress_size`` elements and, with
    ``dense_1d`` (default), tensors of dim ≤ 1 (biases, norm weights) are sent whole: the
    payload is [all values] (fp16 with ``fp16_values``); ctx records it (shape-only, so
    every rank agrees).
    """

    SETTINGS = (
        "compress_ratio",
        "sample_ratio",
        "min_compress_size",
        "dense_1d",
        "fp16_values",
        "warmup_epochs",
        "warmup_steps",
        "warmup_coeff",
        "warmup_ratios",
        "max_adaptation_iters",
        "threshold_decay",
        "seed",
    )
    STATE = ("epoch", "steps", "rng", "current_ratio")
    REPLICATED = STATE  # the warm-up's place and the sampling stream: alike on every rank

    def __init__(
        self,
        compress_ratio: float = 0.001,
        sample_ratio: float = 0.01,
        min_compress_size: int = 1024,
        dense_1d: bool = True,
        fp16_values: bool = False,
        warmup_epochs: int = 0,
        warmup_steps: int = 0,
        warmup_coeff: float | None = None,
        warmup_ratios: list[float] | tuple[float, ...] | None = None,
        max_adaptation_iters: int = 10,
        threshold_decay: float = 0.8,
        seed: int = 0,
    ) -> None:
        self.compress_ratio = check_range("compress_ratio", compress_ratio, 0, 1, low_open=True)
        self.sample_ratio = check_range("sample_ratio", sample_ratio, 0, 1, low_open=True)
        self.min_compress_size = check_range("min_compress_size", min_compress_size, 0, kind=int)
        self.dense_1d = check_bool("dense_1d", dense_1d)
        self.fp16_values = check_bool("fp16_values", fp16_values)
        self.warmup_epochs = check_range("warmup_epochs", warmup_epochs, 0, kind=int)
        self.warmup_steps = check_range("warmup_steps", warmup_steps, 0, kind=int)
        if self.warmup_epochs and self.warmup_steps:
            raise GraceConfigError("give warmup_epochs or warmup_steps, not both")
        self.warmup_ratios: list[float] | None = None
        if warmup_ratios is not None:
            if warmup_coeff is not None or not isinstance(warmup_ratios, (list, tuple)) or not warmup_ratios:
                raise GraceConfigError(
                    "warmup_ratios must be a non-empty list of ratios in (0, 1] (and excludes warmup_coeff)"
                )
            self.warmup_ratios = [check_range("warmup_ratios[]", r, 0, 1, low_open=True) for r in warmup_ratios]
            if not self.warmup_steps:
                if self.warmup_epochs not in (0, len(self.warmup_ratios)):
                    raise GraceConfigError(
                        f"warmup_ratios has {len(self.warmup_ratios)} entries but "
                        f"warmup_epochs={self.warmup_epochs}; accepted: equal lengths"
                    )
                self.warmup_epochs = len(self.warmup_ratios)
        self.warmup_coeff = (
            None
            if warmup_coeff is None
            else check_range("warmup_coeff", warmup_coeff, 0, 1, low_open=True, high_open=True)
        )
        self.max_adaptation_iters = check_range("max_adaptation_iters", max_adaptation_iters, 0, kind=int)
        self.threshold_decay = check_range("threshold_decay", threshold_decay, 0, 1, low_open=True, high_open=True)
        self.seed = check_range("seed", seed, 0, kind=int)
        self.rng = random.Random(self.seed)  # own RNG: the global one is left alone
        self.epoch = 0
        self.steps: dict[str, int] = {}  # name -> compress calls so far
        self.current_ratio = self.ratio_at(0)

    # -- warm-up schedule --------------------------------------------------------------
    def ratio_at(self, position: int) -> float:
        length = self.warmup_steps or self.warmup_epochs
        if position >= length:
            return self.compress_ratio
        if self.warmup_ratios is not None:
            return self.warmup_ratios[position * len(self.warmup_ratios) // length]
        if self.warmup_coeff is not None:
            return max(self.warmup_coeff ** (position + 1), self.compress_ratio)
        return self.compress_ratio ** ((position + 1) / length)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = check_range("epoch", epoch, 0, kind=int)
        if not self.warmup_steps:
            self.current_ratio = self.ratio_at(self.epoch)

    def stats(self) -> dict[str, Any]:
        return {"dgc_compress_ratio": self.current_ratio}

    # -- selection --------------------------------------------------------------------
    def is_dense(self, tensor: Tensor) -> bool:
        n = tensor.numel()
        return n == 0 or n < self.min_compress_size or (self.dense_1d and tensor.dim() <= 1)

    def select(self, values: Tensor, k: int) -> Tensor:
        """Indices (int64) of between k and ⌊13k/10⌋ elements of the 1-D ``values`` by
        magnitude (``values`` may be the gradient or its magnitudes: |·| is taken)."""
        n = values.numel()
        stride = n // max(math.ceil(self.sample_ratio * n), math.ceil(2 * n / k))
        if stride <= 1:  # the sample would be the whole tensor: select exactly
            return torch.topk(values.abs(), k, sorted=False).indices
        stride |= 1  # odd, so it does not keep hitting the same columns of 2^m-wide rows
        samples = values[self.rng.randrange(stride) :: stride].abs()
        threshold = torch.topk(samples, math.ceil(samples.numel() * k / n), sorted=False).values.min()
        for attempt in range(self.max_adaptation_iters + 1):
            if attempt:  # too few passed: lower the threshold and retry
                threshold = threshold * self.threshold_decay
            # C = {i : |g_i| ≥ τ}, chunk by chunk, with |g_C|
            candidates, magnitudes = at_least(values, threshold, self.workspace, keep_nan=False)
            if candidates.numel() >= k:
                break
        else:  # bounded retries exhausted (e.g. one huge element): exact top-k
            return torch.topk(values.abs(), k, sorted=False).indices
        if candidates.numel() > (13 * k) // 10:
            candidates = candidates[torch.topk(magnitudes, k, sorted=False).indices]
        return candidates

    # -- the compressor interface ----------------------------------------------------------
    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, SparseContext]:
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        if self.warmup_steps:
            self.current_ratio = self.ratio_at(step)
        dense = self.is_dense(tensor)
        ctx = SparseContext(tensor.shape, tensor.dtype, whole=dense)
        values_dtype = torch.float16 if self.fp16_values else tensor.dtype
        flat = tensor.reshape(-1)
        if dense:  # may alias the input (interfaces: aliasing); memories update after the aggregate
            return [flat.to(values_dtype)], ctx
        k = max(1, int(flat.numel() * self.current_ratio))
        values, indices = sparse_payload(flat, self.select(flat, k))
        return [values.to(values_dtype), indices], ctx

    def state_dict(self) -> dict[str, Any]:  # the sampling RNG as its state tuple
        return dict(super().state_dict(), rng=self.rng.getstate())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng = self.rng
        super().load_state_dict(state)
        self.rng = rng
        rng.setstate(state["rng"])
