import zlib

import torch

from ..errors import check_range
from ..interfaces import Compressor
from ..registry import register_compressor


@register_compressor("randomk")
class RandomKCompressor(Compressor):
    """Random-k sparsification with indices shared by all ranks (Stich et al. 2018):

        S_t = first k of a permutation drawn from seed ⊕ crc32(name) ⊕ t,   payload = g_{S_t}.

    Every rank draws the same S_t from its own ``torch.Generator`` (the global RNG is not
    touched), so only the k values travel and payloads are summable (allreduce).
    """
    summable = True

    def __init__(self, compress_ratio=0.01, seed=0):
        self.compress_ratio = check_range("compress_ratio", compress_ratio, 0, 1, low_open=True)
        self.seed = check_range("seed", seed, 0, kind=int)
        self.steps = {}      # name -> how many times that tensor was compressed

    def indices(self, name, numel, step):
        generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + step) % 2**63)
        k = max(1, int(numel * self.compress_ratio)) if numel else 0
        return torch.randperm(numel, generator=generator)[:k]

    def compress(self, tensor, name):
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        flat = tensor.reshape(-1)
        indices = self.indices(name, flat.numel(), step).to(tensor.device)
        return [flat[indices]], (indices, tensor.shape)

    def decompress(self, payload, ctx):
        indices, shape = ctx
        dense = payload[0].new_zeros(torch.Size(shape).numel())
        dense[indices] = payload[0]
        return dense.view(shape)

    def sent_mask(self, payload, ctx):
        indices, shape = ctx      # the shared index set, a sent zero included
        mask = torch.zeros(torch.Size(shape).numel(), dtype=torch.bool, device=payload[0].device)
        mask[indices] = True
        return mask.view(shape)

    def state_dict(self):
        return {"steps": dict(self.steps)}

    def load_state_dict(self, state):
        self.steps = dict(state["steps"])
