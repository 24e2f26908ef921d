"""Every environment variable grace_dgc reads: what it means, whether the ranks compare it,
and one checked reader. A bad value is a one-line :class:`GraceConfigError` naming the
variable and what is accepted, never a bare ``ValueError`` deep inside a step.

``tests/core/test_declarations.py`` fails when the library reads a variable that is not listed
here, or lists one it no longer reads.
"""

from __future__ import annotations

import os

from .errors import GraceConfigError

VARIABLES = {
    "LOCAL_WORLD_SIZE": "ranks per machine (torchrun): hierarchical's default group_size; the ranks compare "
    "the group size in effect at the handshake",
    "LOCAL_RANK": "this rank's index on its machine (torchrun): which GPU it uses; rank-local on purpose",
    "WORLD_SIZE": "the launcher's number of ranks: engine='auto' refuses to train alone under a launcher",
    "HOROVOD_SIZE": "as WORLD_SIZE, under horovodrun",
    "OMPI_COMM_WORLD_SIZE": "as WORLD_SIZE, under Open MPI's mpirun",
    "PMI_SIZE": "as WORLD_SIZE, under MPICH/Slurm's PMI",
    "GRACE_DGC_DEBUG": "the command line prints full tracebacks (0/1); rank-local on purpose",
    "GRACE_DGC_KERNELS": "which code packs and unpacks bits: auto (default: the fused Triton kernels on CUDA when "
    "Triton imports, else the torch ops), torch, or triton (always; CPU tensors only under TRITON_INTERPRET=1); "
    "rank-local on purpose: every path writes the same bytes; read once, when first needed "
    "(grace_dgc.kernels.set_mode changes it at run time)",
    "OMP_NUM_THREADS": "intra-op threads per rank (OpenMP's own variable): when set, the one value every launcher "
    "(run_local, RankPool, and the launchers that read grace_dgc.launch.threads_per_rank) gives each rank; else "
    "cores / ranks. Rank-local on purpose: it changes speed, not results",
    "TRITON_INTERPRET": "Triton's own switch to its interpreter (1): with GRACE_DGC_KERNELS=triton the kernels run "
    "on CPU tensors, which is how the tests prove them without a GPU; rank-local",
}


def read_int(name: str, default: int | None = None, low: int = 0) -> int | None:
    """``name`` as a whole number >= ``low``, or ``default`` when unset."""
    assert name in VARIABLES, name
    text = os.environ.get(name)
    if text is None:
        return default
    if not text.strip().isdigit() or int(text) < low:
        raise GraceConfigError(
            f"{name}={text!r} in the environment; accepted: a whole number >= {low} ({VARIABLES[name]})"
        )
    return int(text)
