from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import wire
from ..errors import GraceConfigError, check_bool
from ..interfaces import Communicator, Compressor, Cost, Ctxs, Payloads, Sent, Tensors
from ..registry import register_communicator
from .chunked import Chunked


@register_communicator("reduce_scatter", aliases=("reducescatter", "sra"))
class ReduceScatter(Communicator):
    """Compressed reduce-scatter + allgather of quantized chunks, with error feedback on each chunk's owner

    CGX (Markov et al. 2022). For quantizers (qsgd, terngrad, natural, twobit, onebit,
    efsignsgd, signsgd/signum with their majority vote): any compressor that can compress a
    tensor chunk by chunk (``chunkable``, not ``sparse``, one round).

    With N ranks, each tensor x is cut into N chunks x[j] (equal up to one element); rank j
    owns chunk j. C is the compressor, D its decompression, C'/D' its ``requantize`` /
    ``dequantize_into`` (C/D themselves except for the majority vote, sent exactly in 2 bits):

    1. every rank compresses each chunk, c_r[j] = C(x_r[j]) (Grace's memory keeps each
       rank's own error, e_r ← x_r − D(c_r), as with any communicator), and sends c_r[j]
       to rank j (all_to_all);
    2. owner j aggregates, a_j = (1/N) Σ_r D(c_r[j])  (the vote sign(Σ_r D(c_r[j])) for
       majority-vote methods), adds its carried error and requantizes:
            q_j = a_j + ε_j,   c_j = C'(q_j),   ε_j ← q_j − D'(c_j)
       (error feedback on the owner, as in CGX and EF21: the second quantization's error is
       sent later, never lost; ``error_feedback=False`` drops it, as GRACE's alltoall did);
    3. every rank gathers the c_j (allgather) and the aggregate is D'(c_j) on chunk j
       (times N before Grace's division by N, for averaging methods).

    Bytes per rank: (N−1)/N of one compressed tensor out in step 1 and (N−1)·|c_j| ≈
    (N−1)/N of one compressed tensor in through step 3: ≈ 2·(N−1)/N, like a ring allreduce,
    where allgather moves (N−1) whole compressed tensors in. Every rank receives the same
    c_j, so all ranks hold identical results. Chunking changes per-tensor statistics (QSGD's
    last bucket, TernGrad's scale, 1-bit's means are per chunk).
    """

    SETTINGS = ("error_feedback",)
    STATE = ("errors",)
    RESET_WHEN_RANKS_CHANGE = True  # each owner's error on its chunk of N

    @classmethod
    def cost(cls, nodes: int, nbytes: float, dense_bytes: float, **settings: Any) -> Cost:
        """Chunks to their owners and the requantized chunks back, sizes then data both ways:
        4(N−1) steps, 2(N−1)/N · n bytes."""
        share = (nodes - 1) / nodes  # own chunks out; the owner's requantized chunk, gathered
        return Cost(
            4 * (nodes - 1), 2 * share * nbytes, share * nbytes + nbytes / nodes, (2 * nodes - 2) / nodes * nbytes
        )

    def __init__(self, engine: Any, error_feedback: bool = True) -> None:
        super().__init__(engine)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.errors: dict[str, Tensor] = {}  # tensor name -> ε of the chunk this rank owns

    @classmethod
    def refusal(cls, compressor: Compressor) -> str | None:
        reason = super().refusal(compressor)  # several rounds per step
        if reason is None and (compressor.sparse or not compressor.chunkable):
            reason = (
                "it selects elements across the whole tensor, so it cannot be compressed chunk by chunk "
                "(sparse payloads go by sparse_allreduce; a plugin quantizer declares chunkable = True)"
            )
        return reason

    def wire_compressor(self, compressor: Compressor) -> Compressor:
        return Chunked(compressor, self.engine.size)

    def aggregate_into(
        self, comp: Compressor, payloads: Payloads, ctxs: Ctxs, names: list[str], outs: Tensors, consume: bool = False
    ) -> Sent:
        assert isinstance(comp, Chunked)
        engine, inner, n, me = self.engine, comp.inner, self.engine.size, self.engine.rank
        parts, received = self.to_owners(comp, payloads, ctxs)  # 1. chunk j of every tensor to rank j
        # 2. the owner aggregates its chunk, adds its carried error and requantizes
        requantized = []
        for i, name in enumerate(names):
            start, stop = ctxs[i].bounds[me], ctxs[i].bounds[me + 1]
            first = sum(len(chunks[me]) for chunks in parts[:i])
            own = [tensors[first : first + len(parts[i][me])] for tensors in received]
            total = torch.empty(stop - start, dtype=outs[i].dtype, device=outs[i].device)
            inner.decompress_aggregate_into(own, ctxs[i].parts[me], total)
            if inner.average:
                total.div_(n)
            carried = self.errors.get(name)
            if carried is not None:
                total.add_(carried)
            payload, ctx = inner.requantize(total, f"{name}#{me}/aggregate")
            if self.error_feedback:
                # out of place: the payload may be ``total`` itself (``none``), and is sent below
                self.errors[name] = total - inner.dequantize_into(payload, ctx, torch.empty_like(total))
            requantized.append(payload)
        # 3. everyone gathers every owner's requantized chunk
        buffer, header = wire.encode([t for p in requantized for t in p])
        template = [t for p in requantized for t in p]
        gathered_heads = engine.allgather(header)
        buffers = engine.allgather(buffer, sizes=[int(h.sum()) for h in gathered_heads])
        for j, (data, head) in enumerate(zip(buffers, gathered_heads)):
            tensors, first = wire.decode(data, head, template), 0
            for i, out in enumerate(outs):
                width = len(requantized[i])
                start, stop = ctxs[i].bounds[j], ctxs[i].bounds[j + 1]
                chunk = out.view(-1)[start:stop]
                inner.dequantize_into(tensors[first : first + width], ctxs[i].parts[j], chunk)
                if inner.average:
                    chunk.mul_(n)
                first += width
        return payloads, ctxs

    def to_owners(self, comp: Chunked, payloads: Payloads, ctxs: Ctxs) -> tuple[list[list[Any]], list[list[Tensor]]]:
        """Step 1: chunk j of every tensor to rank j, per-tensor byte lengths first, then the
        bytes. Returns each tensor's chunk payloads (``parts[i][j]``) and what this rank, the
        owner, received from every rank (``received[r]``: rank r's payloads of this rank's chunks)."""
        engine, n, me = self.engine, self.engine.size, self.engine.rank
        parts = [comp.split(p, c) for p, c in zip(payloads, ctxs)]  # parts[i][j]: tensor i, chunk j
        blocks, heads = zip(*(wire.encode([t for chunks in parts for t in chunks[j]]) for j in range(n)))
        mine = [t for chunks in parts for t in chunks[me]]  # the template of what owner me receives
        got_heads = engine.all_to_all(torch.cat(heads), [h.numel() for h in heads], [len(mine)] * n).view(n, -1)
        lengths = got_heads.sum(dim=1).tolist()
        got = engine.all_to_all(torch.cat(blocks), [b.numel() for b in blocks], lengths)
        return parts, [wire.decode(b, h, mine) for b, h in zip(got.split(lengths), got_heads)]

    def state_numels(self, key: str, shape: torch.Size) -> set[int]:
        """An owner's error covers its chunk of the tensor: any owner's size, since a rank-0
        checkpoint's optimizer state carries rank 0's, which ``load_gathered_state`` then
        replaces with this rank's own."""
        bounds = Chunked.bounds_of(shape.numel(), self.engine.size)
        return {stop - start for start, stop in zip(bounds, bounds[1:])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("errors") and not self.error_feedback:  # they would be added again at every step
            raise GraceConfigError(
                f"this state carries the owner errors of {len(state['errors'])} tensors (saved with "
                "error_feedback=True); this reduce_scatter has error_feedback=False: build it with "
                "error_feedback=True to resume"
            )
        super().load_state_dict(state)
