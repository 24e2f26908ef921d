"""The configuration handshake: ranks check that they run the same thing.

Collectives match by order, so ranks that differ in what they run (another communicator,
another seed, another parameter list) would hang, abort inside the runtime or diverge without
a word. Ranks compare one int64 hash per field below (an allgather: a fixed-size message,
so ranks that disagree still meet in it):

* when Grace binds, before any set-up runs collectives of its own (``hierarchical`` forms
  node groups, ``auto`` measures the link): the settings fields, which every part derives
  from its declaration (:class:`~grace_dgc.interfaces.Part`), so a new parameter cannot be
  missed here and kept in the checkpoint, or the other way round;
* at the first exchange of each group (and again whenever a group's tensors change): every
  field, the group's tensors and the plan included. The plan is every group of one step,
  when a DistributedOptimizer declared it: a rank with one more group then differs at its
  first handshake, not in a mismatched collective later.

On any difference every rank gathers the others' descriptions and raises a
:class:`~grace_dgc.errors.GraceConfigError` naming the fields, the ranks and their values.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .errors import GraceConfigError, on_every_rank

if TYPE_CHECKING:
    from .engines.base import Engine
    from .grace import Grace

SETTINGS_FIELDS = (
    "world size",
    "compressor",
    "memory",
    "communicator",
    "compressor parameters",
    "memory parameters",
    "communicator parameters",
    "non-finite policy",
    "way in (its settings)",
)
GROUP_FIELDS = (
    "tensors (name, shape, dtype)",
    "exchange plan (the groups of one step)",
)
FIELDS = SETTINGS_FIELDS + GROUP_FIELDS


def tensor_list(names: Sequence[str], tensors: Sequence[Tensor]) -> list[tuple[str, tuple[int, ...], str]]:
    """[(name, shape, dtype)] as the ranks compare them."""
    return [(n, tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in zip(names, tensors)]


def describe(
    grace: Grace, tensors: Sequence[Tensor] | None = None, names: Sequence[str] | None = None
) -> dict[str, str]:
    """This rank's value of each field, as text (the settings fields only without tensors)."""
    settings = grace.settings()
    values = [str(grace.engine.size)]
    values += [settings[kind]["name"] for kind in ("compressor", "memory", "communicator")]
    values += [_listed(settings[kind]["settings"]) for kind in ("compressor", "memory", "communicator")]
    values.append(str(settings["nonfinite"]))
    values.append(_listed(settings["way_in"]))
    if tensors is None:
        return dict(zip(SETTINGS_FIELDS, values))
    assert names is not None  # given with the tensors
    values.append(repr(tensor_list(names, tensors)))
    values.append(grace.plan)
    return dict(zip(FIELDS, values))


def _listed(settings: Mapping[str, object]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sorted(settings.items())) or "(none)"


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def agree_settings(grace: Grace) -> None:
    """:func:`agree` on the settings fields, before the parts set up."""
    engine = grace.engine
    _compare(engine, describe(grace), SETTINGS_FIELDS, engine.control_device)


def agree(grace: Grace, tensors: Sequence[Tensor], names: Sequence[str]) -> None:
    """Raise on every rank if the ranks' fields differ; return quietly if they agree."""
    # on the gradients' device: the one every collective of this group uses (NCCL needs CUDA)
    _compare(grace.engine, describe(grace, tensors, names), FIELDS, tensors[0].device)


def _compare(engine: Engine, mine: dict[str, str], fields: Sequence[str], device: torch.device) -> None:
    if engine.size == 1:
        return
    hashes = torch.tensor([_hash(mine[field]) for field in fields], dtype=torch.int64, device=device)
    table = torch.stack(engine.allgather(hashes)).cpu()
    differing = [i for i, field in enumerate(fields) if bool((table[:, i] != table[0, i]).any())]
    if not differing:
        return
    everyone = [engine.broadcast_object(mine if engine.rank == root else None, root) for root in range(engine.size)]
    details = []
    for i in differing:
        field = fields[i]
        shown = "; ".join(f"rank {rank}: {_short(d[field])}" for rank, d in enumerate(everyone))
        details.append(f"{field} — {shown}")
    raise on_every_rank(
        GraceConfigError(
            "the ranks run different configurations (every rank must build the same methods with the same "
            "parameters and exchange the same tensors in the same order): " + " | ".join(details)
        )
    )


FINGERPRINT_CHUNK = 2**20  # elements summed at once (an int64 copy of 8 MB)


def fingerprint(tensor: Tensor) -> Tensor:
    """One int64 of ``tensor``'s values: the sum of their bit patterns. Integer sums do not
    depend on the order of the additions (two's complement wraps), so ranks that hold the same
    values get the same number whatever their threads or device, and different ones almost
    never do."""
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(tensor.element_size())
    values = (tensor.detach() if as_int is not None else tensor.detach().float()).view(as_int or torch.int32)
    if values.numel() <= FINGERPRINT_CHUNK:
        return values.sum(dtype=torch.int64)
    # in pieces: an int64 sum makes an int64 copy of what it sums (the whole model's worth at once
    # was 100 MB more peak memory at the first step of a 25M-parameter model)
    total = torch.zeros((), dtype=torch.int64, device=values.device)
    for piece in values.flatten().split(FINGERPRINT_CHUNK):
        total += piece.sum(dtype=torch.int64)
    return total


def agree_replicas(engine: Engine, params: Mapping[str, Tensor], device: torch.device) -> None:
    """Raise on every rank when the ranks' ``params`` (name -> tensor) hold different values:
    one fixed-size allgather of a hash of every parameter's :func:`fingerprint`; on a
    difference, every rank's fingerprints to name the parameters that differ."""
    if engine.size == 1 or not params:
        return
    prints = torch.stack([fingerprint(p) for p in params.values()]).cpu()
    digest = hashlib.blake2b(prints.numpy().tobytes(), digest_size=8).digest()
    mine = torch.tensor([len(params), int.from_bytes(digest, "little") >> 1], dtype=torch.int64, device=device)
    table = torch.stack(engine.allgather(mine)).cpu()
    if bool((table == table[0]).all()):
        return
    everyone = [engine.broadcast_object(prints if engine.rank == root else None, root) for root in range(engine.size)]
    names = list(params)
    differing = [
        name
        for i, name in enumerate(names)
        if any(len(other) != len(names) or other[i] != everyone[0][i] for other in everyone)
    ]
    shown = ", ".join(differing[:6]) + (f" and {len(differing) - 6} more" if len(differing) > 6 else "")
    raise on_every_rank(
        GraceConfigError(
            f"the ranks train different models: the values of {shown or 'the parameter list'} differ between "
            "ranks at the first step (each rank initialized its own, e.g. seeded by its rank). Call "
            "grace_dgc.broadcast_parameters(model.state_dict(), root_rank=0) once after building the model "
            "(and after loading a checkpoint), as DDP does at construction"
        )
    )


def _short(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


# -- a saved state agrees with this Grace, or is refused by name before anything loads -----------
STATE_FORMAT = 2
READABLE_FORMATS = (1, 2)  # 1: an earlier header, without the settings


def describe_methods(methods: Mapping[str, str]) -> str:
    return "compressor {compressor!r}, memory {memory!r}, communicator {communicator!r}".format(**methods)


def refuse_another_state(grace: Grace, state: Any, healing: bool = False) -> None:
    """A :meth:`Grace.state_dict` of other methods or another world size is refused with an
    error naming both (per-rank state such as residuals has no meaning on a different number
    of ranks), and one of other settings unless a part declares that the difference does not
    change its state (``RESUME_MAY_DIFFER``); a state without the header (grace_dgc 0.1) loads.
    ``healing``: a peer's state, of which no per-rank part is kept: any world size."""
    if not isinstance(state, dict) or "compressor" not in state or "memory" not in state:
        raise GraceConfigError(
            "load_state_dict needs a Grace.state_dict(): a dict with 'compressor' and "
            f"'memory', got {type(state).__name__} with keys {sorted(state)[:6]}"
            if isinstance(state, dict)
            else f"load_state_dict needs a Grace.state_dict() dict, got {type(state).__name__}"
        )
    if "format" in state:
        if state["format"] not in READABLE_FORMATS:
            raise GraceConfigError(
                f"state format {state['format']!r} is not supported; accepted: {', '.join(map(str, READABLE_FORMATS))}"
            )
        mine = grace._methods()
        if state["methods"] != mine:
            raise GraceConfigError(
                f"the state was saved by {describe_methods(state['methods'])}; this Grace is "
                f"{describe_methods(mine)}: build the same methods to resume"
            )
        if state["world_size"] != grace.world_size and not healing:
            raise GraceConfigError(
                f"the state was saved on {state['world_size']} ranks; this run has "
                f"{grace.world_size}: per-rank state (residuals, momenta) does not carry over"
            )
        _refuse_other_settings(grace, state.get("settings"))


def _refuse_other_settings(grace: Grace, saved: dict[str, dict[str, str]] | None) -> None:
    """Refuse a state saved with other settings, unless a part declares that the
    difference does not change its state's layout or meaning (``RESUME_MAY_DIFFER``)."""
    if saved is None:  # format 1
        return
    mine = grace.settings()
    differing = []
    for kind, part in grace._parts():
        now = mine[kind]["settings"]
        for key in sorted(set(saved.get(kind, {})) | set(now)):
            then = saved.get(kind, {}).get(key, "(not set)")
            if then != now.get(key, "(not set)") and key not in part.RESUME_MAY_DIFFER:
                differing.append(
                    f"{kind} {mine[kind]['name']} {key}: saved {then}, this run {now.get(key, '(not set)')}"
                )
    if differing:
        raise GraceConfigError(
            "the state was saved with other settings, which change what it means: "
            + "; ".join(differing)
            + ". Build with the saved settings to resume"
        )


def warn_of_a_partial_resume(grace: Grace) -> None:
    """A run whose optimizer state was restored while grace's was not (or was another
    rank's) trains on, with its error feedback, momenta or Q lost: say so once."""
    if not any(part.STATE for _, part in grace._parts()):
        return  # nothing of grace's to lose
    fix = grace._resume_route or (
        "save every rank's grace state (grace_dgc.gather_state(optimizer or schedule) into rank 0's file, "
        "restored with grace_dgc.load_gathered_state; or grace_dgc.PerRankState with "
        "torch.distributed.checkpoint; or the DistributedOptimizer's or schedule's state_dict() written by "
        "every rank)"
    )
    if grace._loaded_rank is not None and grace._loaded_rank != grace.rank:
        warnings.warn(
            f"rank {grace.rank} resumed from rank {grace._loaded_rank}'s grace state, which holds that rank's "
            f"memory, not this one's: {fix}",
            stacklevel=2,
        )
    elif grace._loaded_rank is None and grace._watched_optimizer is not None and grace._watched_optimizer.state:
        warnings.warn(
            "the optimizer has state (a resumed run?) but grace's state starts empty: what the "
            f"{describe_methods(grace._methods())} kept (error feedback, momenta, factors) was not "
            f"restored; {fix}",
            stacklevel=2,
        )
