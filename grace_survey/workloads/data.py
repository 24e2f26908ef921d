"""A workload's data splits, held in memory or streamed, behind one interface for the training
loop.

A split is either ``(inputs, targets)`` — two CPU tensors with one row per example — or a
map-style :class:`torch.utils.data.Dataset` whose items are ``(input, target)`` pairs (image
folders, token files: anything too large to hold, or read lazily). The loop never looks
inside: it asks for the size, a subset, or the batches of a list of indices.

Fairness does not depend on the kind: the runner draws the epoch's permutation from
(seed, epoch) and each rank asks for the rows of its share of every global batch, so a
Dataset yields exactly the examples, in exactly the order, that the same data held as
tensors would (tested). A Dataset is read through a :class:`~torch.utils.data.DataLoader`
whose batch sampler is that list: each rank reads only its own shard, in
``loader_workers`` background processes if the workload asks for them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from grace_dgc.errors import GraceConfigError

Split = tuple[Tensor, Tensor] | Dataset[Any]


def is_streamed(split: Split) -> bool:
    return isinstance(split, Dataset)


def size(split: Split) -> int:
    """Examples in ``split``."""
    if isinstance(split, Dataset):
        return len(split)  # type: ignore[arg-type]  # map-style datasets have __len__ (checked)
    return len(split[0])


def subset(split: Split, index: Tensor) -> Split:
    """The examples at ``index`` (a 1-D int64 tensor), as the same kind of split."""
    if isinstance(split, Dataset):
        return Subset(split, index.tolist())
    inputs, targets = split
    return inputs[index], targets[index]


def batches(
    split: Split, index_batches: Sequence[Tensor], loader_workers: int = 0, pin_memory: bool = False
) -> Iterator[tuple[Tensor, Tensor]]:
    """``(inputs, targets)`` for each index tensor in ``index_batches``, in that order."""
    if not isinstance(split, Dataset):
        inputs, targets = split
        for index in index_batches:
            yield inputs[index], targets[index]
        return
    loader = DataLoader(
        split,
        batch_sampler=[index.tolist() for index in index_batches],
        num_workers=loader_workers,
        pin_memory=pin_memory,
    )
    for batch in loader:
        yield _pair(batch)


def _pair(batch: Any) -> tuple[Tensor, Tensor]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise GraceConfigError(
            "a workload's Dataset must yield (input, target) pairs; a batch of its items collated to "
            f"{type(batch).__name__}{'' if not hasattr(batch, '__len__') else f' of {len(batch)} parts'}"
        )
    inputs, targets = batch
    return torch.as_tensor(inputs), torch.as_tensor(targets)


def check_split(split: object, what: str) -> Split:
    """``split`` as a split, or a :class:`GraceConfigError` saying what a split may be."""
    accepted = "give (inputs, targets) tensors with one row per example, or a map-style torch Dataset of pairs"
    if isinstance(split, Dataset):
        if not hasattr(split, "__len__"):
            raise GraceConfigError(f"{what} is a Dataset without __len__ (an IterableDataset?); {accepted}")
        if len(split) == 0:
            raise GraceConfigError(f"{what} is an empty Dataset; {accepted}")
        item = split[0]
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise GraceConfigError(f"{what}[0] is a {type(item).__name__}, not an (input, target) pair; {accepted}")
        return split
    if not (isinstance(split, (tuple, list)) and len(split) == 2 and all(isinstance(t, Tensor) for t in split)):
        raise GraceConfigError(f"{what} is a {type(split).__name__}; {accepted}")
    inputs, targets = split
    if inputs.dim() == 0 or targets.dim() == 0 or len(inputs) != len(targets) or len(inputs) == 0:
        raise GraceConfigError(
            f"{what}: inputs of shape {tuple(inputs.shape)} and targets of shape {tuple(targets.shape)} must have the "
            f"same number of rows (at least one); {accepted}"
        )
    return inputs, targets
