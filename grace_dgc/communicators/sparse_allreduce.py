from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..compressors.sparse import sent_whole
from ..errors import check_bool
from ..interfaces import Communicator, Compressor, Cost, Ctxs, Payload, Payloads, Sent, Tensors
from ..registry import register_communicator

SPARSE, DENSE = 0, 1  # how an owner sends its summed region back


RADIX_ROUNDS = 4  # gTop-k's threshold search on fp32 sums: up to 4 histogram allreduces (8 bits each)


@register_communicator("sparse_allreduce", aliases=("sparcml",))
class SparseAllreduce(Communicator):
    """Sparse payloads summed by the owners of index regions, sent back sparse or dense (optionally gTop-k)

    SparCML (Renggli et al. 2019); the owner split of Ok-Topk (Li & Hoefler 2022). For
    compressors with ``sparse = True`` (topk, dgc, threshold, plugins that send
    ``[values, int32 indices]``).

    A fusion group's tensors form one index space of T elements, split into N regions
    R_j = [⌊jT/N⌋, ⌊(j+1)T/N⌋); rank j owns R_j.

    1. each rank sends the (value, index) pairs of its payloads that fall in R_j to rank j
       (one all_to_all; the counts go first, with each tensor's k);
    2. owner j sums what it received: s_j = Σ_r scatter(values_r ∩ R_j) (rank order), over
       the union U_j of the received indices;
    3. every owner sends s_j back to all (allgather, sizes first): as |U_j| (value, index)
       pairs, or as |R_j| dense values when that is smaller (SparCML's dense switch:
       |U_j|·(b+4) > |R_j|·b bytes, b the value's size).

    A tensor whose ctx says it went whole (a ``SparseContext`` with ``whole``: DGC's tensors
    below ``min_compress_size``) is summed by one allreduce. 16-bit values are summed, and sent back, in fp32.

    The result equals allgather's Σ_r scatter(payload_r) up to the order of the sums, and
    every rank receives the same bits (each region is summed by one rank). Bytes per rank:
    ≈ its own k pairs out, and (N−1)/N of the union's pairs in, instead of (N−1)·k.

    ``global_topk=True`` (gTop-k, Shi et al. 2019; the global threshold of Ok-Topk, Li &
    Hoefler 2022): the aggregate keeps only the K_t = max_r k_{r,t} largest |s| of each
    tensor t, and each rank's memory is told that it sent only its pairs at the kept
    indices G_t, so error feedback keeps the rest:

        ĝ_t = Σ_r scatter(payload_r)|_{G_t},    sent_r = payload_r|_{G_t},
        e_r ← p_r − scatter(sent_r)      (residual memory: what was not kept stays).

    G_t is found between steps 2 and 3 without moving any candidate: τ_t, the K_t-th largest
    |s| of the tensor over all owners, by a radix select on the bits of |s| (monotone in |s|
    as integers): per round, every owner counts its undecided candidates by their next 8
    bits (a T×256 histogram), one allreduce sums the counts, and every rank picks the digit
    where the K_t-th falls (those above it are kept, those below dropped). Ties at τ_t go to
    the lowest indices (one allgather of the owners' tie counts, only when some are left).
    At most 4 rounds for fp32 sums (8 for fp64), fewer when the count settles earlier; each
    owner then sends back only its |G_t ∩ R_j| pairs, Σ_j = K_t, so a rank receives about
    (N−1)/N·K_t pairs in step 3 instead of (N−1)/N of the union: O(k), not O(N·k).
    """

    SETTINGS = ("global_topk",)

    @classmethod
    def cost(cls, nodes: int, nbytes: float, dense_bytes: float, **settings: Any) -> Cost:
        """Pairs to their owners, the summed regions back (sparse or dense, whichever is
        smaller; the N payloads taken as disjoint, an upper bound): 4(N−1) steps,
        (N−1)/N · (n + min(N·n, D)) bytes. gTop-k (``global_topk``) adds up to
        :data:`RADIX_ROUNDS` histogram allreduces for its threshold, and
        about one payload of kept pairs comes back: 2(N−1)/N · n bytes."""
        share = (nodes - 1) / nodes
        if settings.get("global_topk"):  # own pairs out; the owner's kept pairs, gathered; the histograms
            histograms = RADIX_ROUNDS * 256 * 4  # int32 counts, one tensor
            sent, received = share * nbytes + nbytes / nodes, 2 * share * nbytes
            steps = 4 * (nodes - 1) + RADIX_ROUNDS * 2 * (nodes - 1)
            return Cost(steps, 2 * share * nbytes, sent + histograms, received + histograms)
        region = min(nodes * nbytes, dense_bytes) / nodes  # own pairs out; an owner's summed region, gathered
        sent, received = share * nbytes + region, share * nbytes + (nodes - 1) * region
        return Cost(4 * (nodes - 1), share * (nbytes + min(nodes * nbytes, dense_bytes)), sent, received)

    def __init__(self, engine: Any, global_topk: bool = False) -> None:
        super().__init__(engine)
        self.global_topk = check_bool("global_topk", global_topk)

    @classmethod
    def refusal(cls, compressor: Compressor) -> str | None:
        if not compressor.sparse:
            return "its payloads are not sparse ([values, indices]); sparse_allreduce sums sparse payloads only"
        if getattr(compressor, "chunk_local", False):
            return "its indices are chunk-local offsets; sparse_allreduce sums values by their global positions"
        return super().refusal(compressor)

    def aggregate_into(
        self, comp: Compressor, payloads: Payloads, ctxs: Ctxs, names: list[str], outs: Tensors, consume: bool = False
    ) -> Sent:
        sent = list(payloads)
        dense = [i for i, ctx in enumerate(ctxs) if sent_whole(ctx)]  # DGC sends small tensors whole
        if dense:
            summed = self.engine.allreduce(torch.cat([payloads[i][0].reshape(-1).to(outs[i].dtype) for i in dense]))
            for i, part in zip(dense, summed.split([outs[i].numel() for i in dense])):
                comp.decompress_into([part], ctxs[i], outs[i])
        sparse = [i for i, ctx in enumerate(ctxs) if not sent_whole(ctx)]
        for dtype in dict.fromkeys(payloads[i][0].dtype for i in sparse):  # one index space per value dtype
            members = [i for i in sparse if payloads[i][0].dtype == dtype]
            kept = self._reduce([payloads[i] for i in members], [outs[i].numel() for i in members], dtype)
            for i, (values, indices) in zip(members, kept):
                comp.decompress_into([values, indices], ctxs[i], outs[i])
                if self.global_topk:
                    own = payloads[i][1]
                    keep = torch.isin(own, indices)
                    sent[i] = [payloads[i][0][keep], own[keep]]
        return sent, ctxs

    def _reduce(self, payloads: list[Payload], numels: list[int], dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
        """Steps 1–3 for tensors whose values share ``dtype``: per tensor, the summed
        (values, int32 indices), ascending."""
        engine, n, me = self.engine, self.engine.size, self.engine.rank
        device = payloads[0][0].device
        offsets = torch.tensor([0, *numels], dtype=torch.int64).cumsum(0)
        total = int(offsets[-1])
        bounds = [total * j // n for j in range(n + 1)]
        dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype  # sums in fp32
        values = torch.cat([p[0].reshape(-1) for p in payloads]).to(dtype)
        where = torch.cat([p[1].long() + int(offsets[t]) for t, p in enumerate(payloads)])
        owner = torch.bucketize(where, torch.tensor(bounds[1:-1], dtype=torch.int64, device=device), right=True)
        if owner.numel() > 1 and not bool((owner[1:] >= owner[:-1]).all()):
            order = torch.argsort(owner, stable=True)
            values, where, owner = values[order], where[order], owner[order]
        counts = torch.bincount(owner, minlength=n).cpu()
        # 1. counts and each tensor's k to every rank, then the (value, index) records
        header = torch.cat([counts.view(n, 1), torch.tensor([p[1].numel() for p in payloads]).expand(n, -1)], 1)
        width = 1 + len(payloads)
        got = engine.all_to_all(header.reshape(-1).to(device), [width] * n, [width] * n).view(n, width).cpu()
        incoming, ks = got[:, 0].tolist(), got[:, 1:].amax(dim=0).tolist()
        local = (where - torch.tensor(bounds[:-1], device=device)[owner]).to(torch.int32)
        size = values.element_size() + 4
        records = _records(values, local)
        received = engine.all_to_all(records, [c * size for c in counts.tolist()], [c * size for c in incoming])
        # 2. the owner sums its region over the union of received indices: O(pairs received),
        # never a pass over the region (sums in arrival order, i.e. rank order)
        got_values, got_index = _unrecords(received, dtype)
        union, slot = torch.unique(got_index.long(), sorted=True, return_inverse=True)
        summed = torch.zeros(union.numel(), dtype=dtype, device=device).index_add_(0, slot, got_values)
        if self.global_topk:  # only the pairs among the K_t largest of the whole sum
            keep = self._global_top(summed, union + bounds[me], offsets, ks)
            union, summed = union[keep], summed[keep]
        # 3. back to every rank, sparse or dense, whichever is smaller
        return self._share(summed, union, bounds, offsets, values.element_size(), len(payloads))

    def _share(
        self, summed: Tensor, union: Tensor, bounds: list[int], offsets: Tensor, width: int, count: int
    ) -> list[tuple[Tensor, Tensor]]:
        """Step 3: every owner's summed region to every rank, as (value, index) records or
        dense, whichever is smaller; cut back into the ``count`` tensors' (values, indices)."""
        engine, me, dtype, device = self.engine, self.engine.rank, summed.dtype, summed.device
        span, size = bounds[me + 1] - bounds[me], width + 4
        mode = SPARSE if self.global_topk or union.numel() * size <= span * width else DENSE
        if mode == SPARSE:
            mine = _records(summed, union.to(torch.int32))
        else:
            mine = torch.zeros(span, dtype=dtype, device=device).index_put_((union,), summed).view(torch.uint8)
        heads = engine.allgather(torch.tensor([mode, mine.numel()], dtype=torch.int64, device=device))
        sizes = [h.tolist() for h in heads]
        regions = engine.allgather(mine, sizes=[h[1] for h in sizes])
        parts_v: list[Tensor] = []
        parts_i: list[Tensor] = []
        for j, ((kind, _), region) in enumerate(zip(sizes, regions)):
            if kind == SPARSE:
                v, i = _unrecords(region, dtype)
                parts_v.append(v)
                parts_i.append(i.long() + bounds[j])
            else:  # a region may start mid-element of a wider dtype (Horovod's allgather packs regions unpadded)
                aligned = region.storage_offset() % region.new_empty((), dtype=dtype).element_size() == 0
                parts_v.append((region if aligned else region.clone()).view(dtype))
                parts_i.append(torch.arange(bounds[j], bounds[j + 1], device=device))
        all_v, all_i = torch.cat(parts_v), torch.cat(parts_i)
        cuts = torch.searchsorted(all_i, offsets.to(device)).tolist()
        out = []
        for t in range(count):
            v, i = all_v[cuts[t] : cuts[t + 1]], all_i[cuts[t] : cuts[t + 1]] - int(offsets[t])
            out.append((v, i.to(torch.int32)))
        return out

    def _global_top(self, sums: Tensor, where: Tensor, offsets: Tensor, ks: list[int]) -> Tensor:
        """Mask of this owner's candidates (sums ``sums`` at ascending flat indices ``where``)
        that are among the K_t largest |s| of their tensor over all owners (see the class
        docstring: a radix select on the bits of |s| with one allreduce per round)."""
        engine, device, n_tensors = self.engine, sums.device, len(ks)
        tensor = torch.bucketize(where, offsets[1:].to(device), right=True)
        bits = sums.element_size() * 8
        key = sums.view(torch.int32 if bits == 32 else torch.int64).long() & ((1 << (bits - 1)) - 1)  # |s|
        need = torch.tensor(ks, dtype=torch.int64, device=device)  # still to pick, per tensor
        chosen = torch.zeros_like(key, dtype=torch.bool)
        live = torch.ones_like(chosen)  # candidates whose higher digits equal τ_t's
        for shift in range(bits - 8, -1, -8):
            digit = (key >> shift) & 255
            slot = tensor[live] * 256 + digit[live]
            hist = engine.allreduce(torch.bincount(slot, minlength=n_tensors * 256).to(torch.int32)).long()
            atleast = hist.view(n_tensors, 256).flip(1).cumsum(1).flip(1)  # candidates with digit >= d
            atleast = torch.cat([atleast, atleast.new_zeros(n_tensors, 2)], 1)  # d = 256, 257: none
            # τ_t's digit: the largest d with ≥ need candidates at or above it (-1: take all;
            # 256 when nothing is left to pick)
            cut = torch.where(need > 0, (atleast[:, :256] >= need[:, None]).sum(1) - 1, 256)
            above = atleast.gather(1, (cut + 1)[:, None]).view(-1)  # all taken
            at_cut = atleast.gather(1, cut.clamp(min=0)[:, None]).view(-1) - above  # still undecided
            chosen |= live & (digit > cut[tensor])
            need -= above
            live &= digit == cut[tensor]
            if bool(((need == 0) | (at_cut == need) | (cut < 0)).all()):  # every tie is taken (or none is)
                return chosen | (live & (need > 0)[tensor])
        # ties at τ_t: to the lowest indices, i.e. to the owners in rank order
        ties = torch.bincount(tensor[live], minlength=n_tensors)
        before = torch.stack(engine.allgather(ties))[: engine.rank].sum(0)
        allowed = (need - before).clamp(min=0)
        order = live.long().cumsum(0) - 1  # rank of each tie among this owner's, per tensor below
        first = torch.searchsorted(where, offsets.to(device))[:-1]
        base = torch.cat([order.new_zeros(1), live.long().cumsum(0)])[first]
        return chosen | (live & ((order - base[tensor]) < allowed[tensor]))


def _records(values: Tensor, indices: Tensor) -> Tensor:
    """(value, int32 index) pairs as one uint8 buffer, pair after pair."""
    count = values.numel()
    return torch.cat(
        [
            values.contiguous().view(torch.uint8).view(count, values.element_size()),
            indices.contiguous().view(torch.uint8).view(count, 4),
        ],
        dim=1,
    ).view(-1)


def _unrecords(buffer: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`_records`."""
    width = torch.empty((), dtype=dtype).element_size()
    pairs = buffer.view(-1, width + 4)
    # clone, not contiguous(): one pair's row is "contiguous" with its 12-byte stride, and a
    # wider dtype's view needs fresh, aligned memory (an fp64 value at byte 12 cannot be viewed)
    values = pairs[:, :width].clone(memory_format=torch.contiguous_format)
    indices = pairs[:, width:].clone(memory_format=torch.contiguous_format)
    return values.view(dtype).view(-1), indices.view(torch.int32).view(-1)
