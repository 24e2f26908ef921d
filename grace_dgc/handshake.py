"""The configuration handshake: before a fusion group's first exchange, ranks check that they
run the same thing.

Collectives match by order, so ranks that differ in what they run (another communicator,
another seed, another parameter list) would hang, abort inside the runtime or diverge without
a word. At the first exchange of each group (and again whenever a group's tensors change)
every rank allgathers one int64 hash per field below: a fixed-size message, so ranks that
disagree still meet in it. The plan is every group of one step, when a DistributedOptimizer
declared it: a rank with one more group then differs at its first handshake, not in a
mismatched collective later. On any difference every rank gathers the others' descriptions and
raises a :class:`~grace_dgc.errors.GraceConfigError` naming the fields, the ranks and their
values.
"""

import hashlib

import torch

from .errors import GraceConfigError, on_every_rank

FIELDS = (
    "world size",
    "compressor",
    "memory",
    "communicator",
    "compressor parameters",
    "memory parameters",
    "communicator parameters",
    "tensors (name, shape, dtype)",
    "exchange plan (the groups of one step)",
    "non-finite policy",
)


def tensor_list(names, tensors):
    """[(name, shape, dtype)] as the ranks compare them."""
    return [(n, tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in zip(names, tensors)]


def describe(grace, tensors, names):
    """This rank's value of each field, as text."""
    parts = {"compressor": grace.compressor, "memory": grace.memory, "communicator": grace.communicator}
    params = getattr(grace, "params", {})
    values = [str(grace.engine.size)]
    values += [getattr(part, "registered_name", type(part).__name__) for part in parts.values()]
    values += [repr(sorted(params.get(kind, {}).items())) for kind in parts]
    values.append(repr(tensor_list(names, tensors)))
    values.append(getattr(grace, "plan", ""))
    values.append(str(getattr(grace, "nonfinite", "")))
    return dict(zip(FIELDS, values))


def _hash(text):
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def agree(grace, tensors, names):
    """Raise on every rank if the ranks' fields differ; return quietly if they agree."""
    engine = grace.engine
    if engine.size == 1:
        return
    mine = describe(grace, tensors, names)
    # on the gradients' device: the one every collective of this group uses (NCCL needs CUDA)
    hashes = torch.tensor([_hash(mine[field]) for field in FIELDS], dtype=torch.int64, device=tensors[0].device)
    table = torch.stack(engine.allgather(hashes)).cpu()
    differing = [i for i, field in enumerate(FIELDS) if bool((table[:, i] != table[0, i]).any())]
    if not differing:
        return
    everyone = [engine.broadcast_object(mine if engine.rank == root else None, root) for root in range(engine.size)]
    details = []
    for i in differing:
        field = FIELDS[i]
        shown = "; ".join(f"rank {rank}: {_short(d[field])}" for rank, d in enumerate(everyone))
        details.append(f"{field} — {shown}")
    raise on_every_rank(
        GraceConfigError(
            "the ranks run different configurations (every rank must build the same methods with the same "
            "parameters and exchange the same tensors in the same order): " + " | ".join(details)
        )
    )


def _short(text, limit=240):
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"
