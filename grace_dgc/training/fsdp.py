"""grace_dgc inside FSDP2 (torch's ``fully_shard``) and HSDP: compressed gradient reduction
where sharded models spend their bytes.

    model = build_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compression = grace_dgc.fsdp_compression(model, reduce_scatter=grace_dgc.build("qsgd", "residual",
                                             "reduce_scatter", quantum_num=127))

Two seams of FSDP2, one Grace each (either may be left out):

1. **reduce_scatter** — each FSDP module's gradient reduce-scatter
   (``FSDPModule.set_custom_reduce_scatter``). FSDP hands over one flat input of N equal
   chunks, chunk j for rank j (its shard). The Grace runs its whole data path on it —
   memory compensation on this rank's gradient, the compressor applied chunk by chunk, chunk
   j sent to rank j only (one all_to_all), the memory's update — and rank j writes the
   average of the chunks it received into FSDP's output: a reduce-scatter, (N−1)/N of one
   compressed gradient out per rank, nothing gathered back. Compressors that compress chunk
   by chunk and average (fp16, bf16, fp8, qsgd, natural, terngrad, onebit, efsignsgd,
   twobit) are accepted; a selection over the whole tensor (top-k), several
   rounds (PowerSGD) or a rotation of the whole tensor (THC) is refused, naming why. The memory holds this
   rank's error on its whole unsharded gradient (what it sent of it), as a worker error
   does under DDP. ``none`` without memory is FSDP's own reduce-scatter (bit for bit), counted.
2. **replicate** — under HSDP, the all-reduce of each rank's gradient *shard* across the
   replicas. Shard the model on the shard dimension only (``fully_shard(m, mesh=mesh2d["shard"])``)
   and pass a Grace over the replicate group (``process_group=mesh2d["replicate"].get_group()``):
   it runs in FSDP's all-reduce hook (``set_all_reduce_hook``) after the reduce-scatter, in
   place. FSDP hands that hook one flat buffer per module; the Grace gets each parameter's
   local shard *with its shape* instead, under the parameter's name (FSDP2 shards dim 0, so a
   weight's shard is still a matrix; the padding between shards is left out), as one fusion
   group: every composition behaves as under DDP (PowerSGD's factors are shard-sized matrices,
   DGC leaves only the 1-D shards dense, THC pads each shard, not the module), and its memory
   is shard-sized: 1/S of what the same method holds under DDP. A Grace over another group
   than the replicas of this rank's shard is refused by name.

FSDP divides by its shard size (AVG); the Graces average over their groups, so the result
is the mean over all S·R ranks, as native HSDP's. Mixed precision (``reduce_dtype``),
``set_requires_gradient_sync(False)`` accumulation (no reduction runs, so nothing is
exchanged) and ``torch.compile`` of the model act as without grace_dgc.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..communicators.chunked import Chunked
from ..communicators.reduce_scatter import ReduceScatter as ReduceScatterCommunicator
from ..errors import GraceConfigError
from ..grace import Grace
from ..interfaces import Compressor, Ctxs, Payloads, Sent, Tensors
from .driver import Driver

__all__ = ["FSDPCompression", "fsdp_compression"]


class _ScatterOnly(ReduceScatterCommunicator):
    """Step 1 of ``reduce_scatter`` and the owner's sum, nothing requantized or gathered:
    each rank's ``outs`` hold the average on its own chunk only (zeros elsewhere, which FSDP
    never reads)."""

    def aggregate_into(
        self, comp: Compressor, payloads: Payloads, ctxs: Ctxs, names: list[str], outs: Tensors, consume: bool = False
    ) -> Sent:
        assert isinstance(comp, Chunked)
        inner, me = comp.inner, self.engine.rank
        parts, received = self.to_owners(comp, payloads, ctxs)
        first = 0
        for i, out in enumerate(outs):
            start, stop = ctxs[i].bounds[me], ctxs[i].bounds[me + 1]
            width = len(parts[i][me])
            own = [tensors[first : first + width] for tensors in received]
            flat = out.view(-1)
            # the other ranks' chunks are never read, but Grace checks the whole output for a
            # NaN/Inf: zeros there, not what an empty buffer held (the exchange is over, so no
            # payload that aliases ``out`` is still in flight)
            flat[:start].zero_()
            flat[stop:].zero_()
            inner.decompress_aggregate_into(own, ctxs[i].parts[me], flat[start:stop])
            first += width
        return payloads, ctxs


def _fsdp_modules(model: torch.nn.Module) -> list[tuple[str, Any]]:
    found = [(name or "<root>", m) for name, m in model.named_modules() if hasattr(m, "set_custom_reduce_scatter")]
    if not found:
        raise GraceConfigError(
            "this model has no fully_shard-ed module: call torch.distributed.fsdp.fully_shard on its blocks and on "
            "the model first, then fsdp_compression"
        )
    return found


def _param_groups(module: Any) -> list[Any]:
    """The FSDP parameter groups of a ``fully_shard``-ed module."""
    state = module._get_fsdp_state()
    # torch 2.13 keeps a list of parameter groups; 2.11 (seen on a lent GPU machine) keeps one or None
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [group] if (group := getattr(state, "_fsdp_param_group", None)) is not None else []
    return list(groups)


def _group_of(module: Any) -> tuple[Any, Any]:
    """(the reduce-scatter group, the all-reduce group or None) of an FSDP module."""
    groups = _param_groups(module)
    if not groups:
        return None, None
    info = groups[0].mesh_info
    shard = getattr(info, "shard_process_group", None)
    replicate = getattr(info, "replicate_process_group", None)
    return shard, replicate


def _engine_ranks(grace: Grace) -> list[int]:
    """The global ranks of the group a Grace's engine runs over (``auto``: chosen now)."""
    engine = grace.engine.resolve() if hasattr(grace.engine, "resolve") else grace.engine
    group = getattr(engine, "group", None)
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _shard_layout(module: Any, names: dict[int, str]) -> list[tuple[str, torch.Size, int]]:
    """Per parameter of an FSDP module, in the order of its reduce-scatter output: (its name,
    this rank's shard shape, the elements its slot takes there). FSDP2 lays each parameter's
    shard out contiguously (dim 0 sharding; Shard(i>0) is chunked and concatenated along dim
    0 first), then pads it to the slot of the largest rank's shard."""
    layout = []
    for group in _param_groups(module):
        for param in group.fsdp_params:
            name = names.get(id(param.sharded_param), f"{param._module_info.param_name}@{id(param)}")
            layout.append((name, torch.Size(param.sharded_size), int(param.padded_sharded_param_size.numel())))
    return layout


def _shards_of(flat: Tensor, layout: list[tuple[str, torch.Size, int]]) -> list[Tensor]:
    """Each parameter's shard in FSDP's flat reduce-scatter output, as a view of its shape
    (an empty shard, on a rank past a small tensor's rows, is left out alike on its replicas)."""
    flat = flat.view(-1)
    views, offset = [], 0
    for _, size, slot in layout:
        if size.numel():
            views.append(flat[offset : offset + size.numel()].view(size))
        offset += slot
    return views


class _GraceReduceScatter:
    """FSDP2's ``ReduceScatter`` comm, run through a Grace (see the module docstring)."""

    def __init__(self, owner: FSDPCompression, name: str) -> None:
        self.owner, self.name = owner, name

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
        return self.owner._reduce_scatter(output_tensor, input_tensor, group, op, self.name)


#: how an FSDP user restores grace's state, named by the warning of a resume that forgot it
RESUME = "restore the FSDPCompression: put it beside the model's and the optimizer's state in dcp.save and dcp.load"


class FSDPCompression(Driver):
    """What :func:`fsdp_compression` installed: its Graces, their stats, and every rank's state
    for ``torch.distributed.checkpoint`` (a ``Stateful``: put it in the dict you hand to
    ``dcp.save``/``dcp.load`` beside the model's and the optimizer's state dicts). The state is
    this rank's, under a key of its own (DCP would write equal keys once), as bytes: its size
    grows as tensors are first seen; with it, what it belongs to (:attr:`layout`), checked at load."""

    GRACES = ("reduce_scatter", "replicate")
    PLAIN = ("layout",)
    PER_RANK = True
    STATS_PER_GRACE = True

    def __init__(
        self,
        model: torch.nn.Module,
        reduce_scatter: Grace | None,
        replicate: Grace | None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.model, self.reduce_scatter, self.replicate = model, reduce_scatter, replicate
        self._names = {}  # the Graces' tensors are FSDP's flat gradients and shards: the layout checks them
        self.modules = _fsdp_modules(model)
        groups = [_group_of(module) for _, module in self.modules]
        shard_group, replicate_group = next((g for g in groups if g[0] is not None), (None, None))
        if replicate_group is not None:
            raise GraceConfigError(
                "this model is sharded with native HSDP (a 2-D mesh): its replicate all-reduce would run before any "
                "hook. Shard on the shard dimension only, fully_shard(module, mesh=mesh['shard']), and pass "
                "replicate=grace_dgc.build(..., process_group=mesh['replicate'].get_group())"
            )
        self.shard_size = dist.get_world_size(shard_group) if shard_group is not None else 1
        if reduce_scatter is not None:
            self._check_reduce_scatter(reduce_scatter, shard_group)
        if replicate is not None:
            self._check_replicate(replicate, shard_group)
        names = {id(p): n for n, p in model.named_parameters()}
        self.shards: dict[str, list[tuple[str, torch.Size, int]]] = {}  # see _shard_layout
        for name, module in self.modules:
            if reduce_scatter is not None:
                module.set_custom_reduce_scatter(_GraceReduceScatter(self, f"fsdp:{name}"))
            if replicate is not None:
                self.shards[name] = _shard_layout(module, names)
                module.set_all_reduce_hook(self._hook(self.shards[name]))
        if optimizer is not None:  # a resume that restored the optimizer but not grace is warned of
            for grace in (reduce_scatter, replicate):
                if grace is not None:
                    grace.watch({}, optimizer, RESUME)

    def _check_replicate(self, grace: Grace, shard_group: Any) -> None:
        """The replicate Grace must run over the replicas of this rank's shard: the ranks that
        hold the same shard index, one per shard group. Over the world group it would average
        different shards; over the shard group, replicas would never meet."""
        me = dist.get_rank()
        shard_ranks = dist.get_process_group_ranks(shard_group) if shard_group is not None else [me]
        # the handshake compares these over the Grace's ranks: a group whose ranks hold different
        # shard indices (a hand-made group) is refused at the first exchange, naming them
        self._claim(grace, role="replicate", shard_size=self.shard_size, shard_index=shard_ranks.index(me))
        mine = _engine_ranks(grace)
        shared = sorted(set(mine) & set(shard_ranks) - {me})
        if shared:
            raise GraceConfigError(
                f"the replicate Grace runs over ranks {mine}, which include ranks {shared} of this rank's shard "
                f"group {shard_ranks}: those hold other shards of the model, and averaging them mixes different "
                "parameters. Build it with process_group= the replicate group (mesh2d['replicate'].get_group()), "
                "the ranks that hold the same shard as this one"
            )

    def _check_reduce_scatter(self, grace: Grace, group: Any) -> None:
        comp, comm = grace.compressor, grace.communicator
        if comm.registered_name != "reduce_scatter":
            raise GraceConfigError(
                f"the reduce_scatter Grace's communicator is {comm.registered_name!r}; FSDP's reduction is a "
                "reduce-scatter: build it with communicator 'reduce_scatter'"
            )
        reasons = [
            (comp.sparse, "it selects across the whole tensor"),
            (
                not comp.sparse and not comp.chunkable,
                "it is not compressed chunk by chunk (a rotation or statistic over the whole tensor)",
            ),
            (comp.rounds > 1, f"it exchanges in {comp.rounds} rounds"),
            (comp.prerounds, "it agrees on a scale over ranks before compressing (a pre-round)"),
            (not comp.average, "its aggregate is a vote, not an average"),
        ]
        why = [text for refused, text in reasons if refused]
        if why:
            raise GraceConfigError(
                f"compressor {comp.registered_name!r} cannot run FSDP's reduce-scatter: {'; '.join(why)}. It can run "
                "on the replicate dimension under HSDP (replicate=...); accepted here: fp16, bf16, fp8, qsgd, "
                "natural, terngrad, twobit, onebit, efsignsgd"
            )
        self._claim(grace, role="reduce_scatter", shard_size=self.shard_size)
        ranks = dist.get_process_group_ranks(group) if group is not None else [0]
        mine = _engine_ranks(grace)
        if mine != ranks:  # chunk j is rank j's shard in both
            raise GraceConfigError(
                f"the reduce_scatter Grace runs over ranks {mine}, FSDP shards over ranks {ranks}: build it with "
                "process_group= the shard group (mesh['shard'].get_group() under HSDP)"
            )
        grace.communicator = _ScatterOnly(grace.engine, error_feedback=False)

    def _native(self, grace: Grace) -> bool:
        return grace.compressor.registered_name == "none" and grace.memory.identity

    def _reduce_scatter(self, output: Tensor, input_: Tensor, group: Any, op: Any, name: str) -> Any:
        grace = self.reduce_scatter
        assert grace is not None
        n = dist.get_world_size(group)
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise GraceConfigError(
                f"FSDP asked for reduce op {op}; grace_dgc reduces with AVG or SUM (a custom gradient divide factor "
                "is not supported)"
            )
        if self._native(grace):  # FSDP's own reduce-scatter, counted as grace counts: (N−1)/N out and in
            moved = input_.numel() * input_.element_size() * (n - 1) // n
            grace.tally.count_exchange(input_.numel(), name, moved, moved)
            # torch 2.13: reduce_scatter_single (reduce_scatter_tensor warns, deprecated); 2.11 has only the latter
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return reduce_scatter(output, input_, op=op, group=group)
        average = grace.step_group_async([input_], [name], inplace=True).result()[0]
        me = dist.get_rank(group)
        output.copy_(average.view(-1)[me * output.numel() : (me + 1) * output.numel()])
        if op == dist.ReduceOp.SUM:
            output.mul_(n)
        return None

    def _hook(self, layout: list[tuple[str, torch.Size, int]]) -> Any:
        names = [name for name, size, _ in layout if size.numel()]
        expected = sum(slot for _, _, slot in layout)

        def all_reduce(reduce_output: Tensor) -> None:
            grace = self.replicate
            assert grace is not None
            if reduce_output.numel() != expected:
                raise GraceConfigError(
                    f"FSDP's all-reduce hook handed over {reduce_output.numel()} elements where the shards of "
                    f"{', '.join(names[:4])} take {expected}: this torch lays out its reduce-scatter output "
                    "otherwise than grace_dgc reads it (written for torch 2.11-2.13)"
                )
            grace.step_group_async(_shards_of(reduce_output, layout), names, inplace=True).result()

        return all_reduce

    # -- what the state belongs to (the rest follows from the declarations: Driver) -------
    @property
    def layout(self) -> dict[str, Any]:
        """What this rank's state belongs to: its place in the mesh (the shard group and the
        replicate Grace's ranks), and the tensors each seam keeps state for (the reduce-scatter
        seam: each FSDP module's parameters, whose flat gradient it compresses; the replicate
        seam: each parameter's shard shape)."""
        me = dist.get_rank() if dist.is_initialized() else 0
        shard_group = next((g for g, _ in map(_group_of, (m for _, m in self.modules)) if g is not None), None)
        out: dict[str, Any] = {
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "rank": me,
            "shard_group": dist.get_process_group_ranks(shard_group) if shard_group is not None else [me],
        }
        if self.replicate is not None:
            out["replicate_group"] = _engine_ranks(self.replicate)
            out["shards"] = {name: list(size) for layout in self.shards.values() for name, size, _ in layout}
        if self.reduce_scatter is not None:
            names = {id(p): n for n, p in self.model.named_parameters()}
            out["modules"] = {
                f"fsdp:{module_name}": [name for name, _, _ in _shard_layout(module, names)]
                for module_name, module in self.modules
            }
        return out

    @layout.setter
    def layout(self, saved: dict[str, Any]) -> None:
        """Refuse a state saved where this rank held another place or other tensors: loaded, it
        would apply one shard's residuals to another, or end in a size error at the first
        backward."""
        now, differing = self.layout, []
        for key, what in (
            ("world_size", "ranks in all"),
            ("shard_group", "this rank's shard group"),
            ("replicate_group", "the replicate Grace's ranks"),
        ):
            if key in saved and saved[key] != now.get(key):
                differing.append(f"{what}: saved {saved[key]}, now {now.get(key)}")
        for key, what in (("shards", "parameter shards"), ("modules", "fully_shard-ed modules")):
            then, current = saved.get(key, {}), now.get(key, {})
            changed = sorted(n for n in set(then) | set(current) if then.get(n) != current.get(n))
            if key in saved and changed:
                shown = "; ".join(
                    f"{n}: saved {then.get(n, '(none)')}, now {current.get(n, '(none)')}" for n in changed[:3]
                )
                differing.append(f"{what} differ ({len(changed)}): {shown}")
        if differing:
            raise GraceConfigError(
                f"this fsdp_compression state does not fit rank {now['rank']} of this run: "
                + " | ".join(differing)
                + ". Resume on the same mesh, with the same ranks in the same roles and the same fully_shard "
                "wrapping (grace's state is per rank and per shard)"
            )


def fsdp_compression(
    model: torch.nn.Module,
    reduce_scatter: Grace | None = None,
    replicate: Grace | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> FSDPCompression:
    """Install grace_dgc on a ``fully_shard``-ed model (module docstring): ``reduce_scatter``
    compresses FSDP's gradient reduce-scatter, ``replicate`` runs the all-reduce of each
    shard across replicas under HSDP. Call after ``fully_shard``, before the first backward.
    ``optimizer`` (recommended): a resume that restored its state but not grace's (the
    ``FSDPCompression`` left out of ``dcp.load``) is warned of at the first exchange, as the
    DistributedOptimizer does, and error feedback under Adam is warned of once."""
    if reduce_scatter is None and replicate is None:
        raise GraceConfigError("fsdp_compression needs a reduce_scatter Grace, a replicate Grace, or both")
    return FSDPCompression(model, reduce_scatter, replicate, optimizer)
