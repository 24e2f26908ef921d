"""Scratch buffers reused from call to call.

A fresh full-size temporary costs more than the arithmetic done in it on a CPU (the pages
of every large allocation are faulted in anew: about 5× one ``copy_`` for an fp32 tensor),
so the data path keeps its temporaries here instead of allocating them every step.
"""

import torch


class Workspace:
    """One buffer per (slot, dtype, device), grown to the largest size asked for.

    ``get(slot, numel, dtype, device)`` returns a 1-D view of its first ``numel`` elements,
    valid until the next ``get`` of the same slot: a temporary of one call, never something
    returned to the caller. Memory held: per slot, the largest request so far.
    Copies and pickles start empty (buffers are not state).
    """

    def __init__(self):
        self._buffers = {}

    def get(self, slot, numel, dtype, device):
        key = (slot, dtype, torch.device(device))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    def like(self, slot, tensor, dtype=None):
        """A scratch shaped like ``tensor`` (its dtype unless ``dtype`` is given)."""
        dtype = tensor.dtype if dtype is None else dtype
        return self.get(slot, tensor.numel(), dtype, tensor.device).view(tensor.shape)

    def nbytes(self):
        """Bytes held by all buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def __getstate__(self):
        return {"_buffers": {}}

    def __repr__(self):
        return f"Workspace({len(self._buffers)} buffers, {self.nbytes()} bytes)"


CPU_CHUNK = 1 << 20  # elements; a chunk's fp32 temporaries (4 MiB) stay in the cache


def chunks(numel, device, multiple=1):
    """``(start, stop)`` pairs covering ``range(numel)`` in order: chunks of about
    ``CPU_CHUNK`` elements (a multiple of ``multiple``) on a CPU, where temporaries of one
    chunk stay in the cache; one chunk on an accelerator, where launches cost more."""
    if torch.device(device).type != "cpu" or numel <= CPU_CHUNK:
        return [(0, numel)] if numel else []
    size = max(multiple, CPU_CHUNK // multiple * multiple)
    return [(start, min(start + size, numel)) for start in range(0, numel, size)]


def flat_span(tensors):
    """A 1-D tensor over the memory of ``tensors`` when they are contiguous, of one dtype and
    device, and lie back to back in one storage in this order (the views of a fusion
    bucket's flat buffer, or DDP's bucket); else None."""
    first = tensors[0]
    if not first.is_contiguous():
        return None
    storage, offset, total = first.untyped_storage(), first.storage_offset(), 0
    for tensor in tensors:
        if (
            tensor.dtype != first.dtype
            or tensor.device != first.device
            or not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() != storage.data_ptr()
            or tensor.storage_offset() != offset + total
        ):
            return None
        total += tensor.numel()
    if len(tensors) == 1:
        return first.view(-1)
    return first.new_empty(0).set_(storage, offset, (total,))
