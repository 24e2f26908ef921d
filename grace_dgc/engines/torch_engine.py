from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import environment
from ..errors import GraceCommError, GraceConfigError, check_range
from .base import Engine, pad_to

ERROR_KEY = "grace/error/"  # + global rank: the error a rank posted before leaving (see fail)
SEEN_KEY = "grace/error-seen/"  # + global rank: it has read a posted error
LEFT_KEY = "grace/left/"  # + global rank: its process exited normally (see _on_exit)
LEFT_SEEN_KEY = "grace/left-seen/"  # + global rank: it has read who left (see _linger_as_the_stores_host)
DIAGNOSING_KEY = "grace/diagnosing/"  # + global rank: a collective failed there, it meets the others
UNEVEN_HINT = (
    "ranks that run different numbers of steps (uneven data, an early break) must train inside "
    "`with optimizer.join(module=model):` (DistributedOptimizer.join; with the DDP hook, torch's Join)"
)


def bounded(fn: Callable[[], Any], seconds: float) -> Any:
    """``fn()``, or TimeoutError after ``seconds``: the store lives in rank 0's process, and
    while that process is stopped (SIGSTOP, a debugger, swapped out) a store call blocks for
    the store's own timeout (30 minutes by default) instead of failing."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as error:  # handed to the caller
            box["error"] = error

    worker = threading.Thread(target=run, name="grace-store-call", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"no answer within {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


GLOO_SETTLE_SECONDS = 0.1  # at exit, without the GIL (see _on_exit)
_exit: dict[str, Any] = {}  # what this process's one exit handler does (see _on_exit)


def _on_exit(**what: Any) -> None:
    """Add to what the process does at a normal exit, in one ``atexit`` handler however many
    engines it made. ``leave=(store, global rank)``: write LEFT_KEY in the store (bounded,
    best effort), so that a rank still in a collective with this one can say it has left,
    finished, rather than "did not answer" (the usual cause: uneven steps without
    ``join()``). ``settle=True``: then sleep GLOO_SETTLE_SECONDS without the GIL. A gloo worker
    frees a finished collective's tensors after the collective completes, and that needs the
    GIL; one still doing it once the interpreter is finalizing aborts the process
    ("terminate called without an active exception"; the group outlives
    destroy_process_group()). The sleep lets it finish. Joining the
    workers instead would deadlock: torch destroys a group with the GIL held."""
    if not _exit.get("registered"):
        import atexit

        atexit.register(_at_exit)
    _exit.update(what, registered=True)


def _at_exit() -> None:
    leave()
    if _exit.get("settle"):
        time.sleep(GLOO_SETTLE_SECONDS)


def leave() -> None:
    """What a rank does as its work ends, at its exit or, on ranks kept up for job after job
    (:class:`grace_dgc.launch.RankPool`), as a job ends: say in the job's store that it left; on
    rank 0, the store's host, linger until the ranks still exchanging with it know (see
    :func:`_linger_as_the_stores_host`). Once per store."""
    if "leave" in _exit:
        store, global_rank, world = _exit.pop("leave")
        try:
            bounded(lambda: store.set(f"{LEFT_KEY}{global_rank}", "1"), 2)
            if global_rank == 0 and world > 1:
                limit = HOST_WAITS_SECONDS + HOST_NOTICE_SECONDS + HOST_LINGERS_SECONDS + 5
                bounded(lambda: _linger_as_the_stores_host(store, world), limit)
        except Exception:  # the store's host (rank 0) may have exited first; best effort
            pass


HOST_WAITS_SECONDS = 2.0  # at exit, the store's host waits this long for the other ranks to leave too
HOST_NOTICE_SECONDS = 1.0  # then, once grace's groups are broken, this long for a rank to start its diagnosis
HOST_LINGERS_SECONDS = 20.0  # and at most this long for a diagnosing rank to read why
_engines: weakref.WeakSet[TorchEngine] = weakref.WeakSet()  # live engines, whose groups an exit may break


def _linger_as_the_stores_host(store: Any, world: int) -> None:
    """Rank 0 hosts the store, so a rank that leaves its loop first there (uneven steps without
    ``join()``) took the store with it, and a rank still exchanging could only guess why its
    collective failed. Instead, at exit: wait briefly for the others to leave too (the usual end:
    nothing more); if some still run, break grace's own process groups, so that a rank blocked
    in an exchange with this one fails now and starts its diagnosis (``DIAGNOSING_KEY``), and keep
    the store up until each diagnosing rank has read that rank 0 left (``LEFT_SEEN_KEY``). A rank
    busy elsewhere (not in an exchange) does not hold rank 0 beyond ``HOST_NOTICE_SECONDS``. The
    broken exchanges could never complete (this rank will not join them), so nothing is lost."""

    def has(prefix: str, rank: int) -> bool:
        return bool(store.check([f"{prefix}{rank}"]))

    def wait_until(done: Any, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if done():
                return True
            time.sleep(0.05)
        return False

    others = range(1, world)
    if wait_until(lambda: all(has(LEFT_KEY, r) for r in others), HOST_WAITS_SECONDS):
        return
    for engine in list(_engines):
        if engine.group is not None and engine._broken is None:  # never the user's default group
            engine._broken = "rank 0 has left: its process exited"
            engine._release()
    wait_until(lambda: all(has(LEFT_KEY, r) or has(DIAGNOSING_KEY, r) for r in others), HOST_NOTICE_SECONDS)
    # who is diagnosing is read again at every poll: a rank whose collective only timed out joins
    # the meeting late, and the rank already there waits for it before it reads and says so
    # (3 ranks on a busy CI: rank 2 saw the break at once, rank 1 timed out 10 s later)
    wait_until(
        lambda: all(has(LEFT_SEEN_KEY, r) or has(LEFT_KEY, r) for r in others if has(DIAGNOSING_KEY, r)),
        HOST_LINGERS_SECONDS,
    )


# process_group=OWN_GROUP: a new group over every rank, for this engine alone. grace_dgc.build
# gives every Grace one by default: its exchanges run on its communication thread (Streaming
# DiLoCo's fragments, the overlapped buckets) while the training thread issues collectives of its
# own (a logged loss's all_reduce, DDP's, another Grace's handshake); on one group the ranks could
# issue the two in different orders and wait forever, or abort in gloo ("collective mismatch").
OWN_GROUP = "own"
_RELEASED = object()  # the group of an engine that fail() or close() released (never a default group)
DEFAULT_TIMEOUT = 300.0  # seconds: far below torch's 30 min, far above any sane step
POLL_SECONDS = 20e-6  # between checks of an NCCL collective's completion (see TorchEngine._run)
DIAGNOSIS_MARGIN = 5.0  # seconds a survivor waits for the others beyond the collective timeout (see _patience)


class TorchEngine(Engine):
    """torch.distributed (gloo on CPU, NCCL on GPU) on the default or a given process group.

    Each collective waits at most ``timeout`` seconds (default 300). When one fails or times
    out, the surviving ranks meet in the process group's store and the error
    (:class:`~grace_dgc.errors.GraceCommError`) names the ranks that did not answer: stopped,
    hung or dead — instead of a bare "connection reset", or a hang until torch's own 30-min
    timeout.
    """

    name = "torch"
    _broken: str | None = None  # why no collective may start any more (see _run)

    def __init__(self, process_group: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self.timeout = check_range("timeout", timeout, 0, low_open=True)
        self.owns_group = False  # see OWN_GROUP
        self._splits: list[TorchEngine] = []  # engines over the subgroups split() made (closed with this one)
        self._calls = 0
        self._failed = False
        self._broken = None
        if not (dist.is_available() and dist.is_initialized()):
            raise GraceConfigError(
                "engine='torch' needs an initialized process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the env), "
                "or use engine='local' for a single process"
            )
        if isinstance(process_group, str):
            if process_group != OWN_GROUP:
                raise GraceConfigError(
                    f"process_group={process_group!r}; accepted: a torch.distributed process group, None (the "
                    f"default group) or {OWN_GROUP!r} (a group of its own over every rank)"
                )
            # new_group is collective over the default group: every rank builds its Graces in the same
            # order, as it builds its model and optimizer (no barrier: it meets in the store only)
            process_group, self.owns_group = dist.new_group(), True
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)
        # kept apart from the group, which fail() releases: the diagnosis still names ranks
        self._global_ranks = [
            r if process_group is None else dist.get_global_rank(process_group, r) for r in range(self.size)
        ]
        self._group_name = "default" if process_group is None else getattr(process_group, "group_name", "")
        self._backend = dist.get_backend(process_group)
        self._polled = "nccl" in self._backend  # see _run
        _on_exit(leave=(dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()))
        _engines.add(self)
        if "gloo" in self._backend:
            _on_exit(settle=True)

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def local_rank(self) -> int:
        """torchrun's ``LOCAL_RANK`` (the rank itself when launched otherwise)."""
        rank = environment.read_int("LOCAL_RANK", dist.get_rank())
        assert rank is not None
        return rank

    def _global(self, rank: int) -> int:
        return self._global_ranks[rank]

    def _usable(self, kind: str) -> None:
        if self._broken is not None:
            raise GraceCommError(f"{kind} not started on rank {self.rank} of {self.size}: {self._broken}")

    def _run(self, kind: str, launch: Callable[[], Any]) -> None:
        """Run one collective (``launch()`` starts it asynchronously), waiting at most
        ``timeout``; a failure becomes an error naming the ranks that did not answer.

        A group that has failed once is broken for good (gloo's connections to the lost rank
        are gone, and the survivors no longer agree on the collectives' order): every later
        collective fails at once with the first diagnosis, instead of each waiting out its own
        timeout and meeting. A step of many groups otherwise took a timeout and a meeting per
        group before its caller heard of the failure (issue 53)."""
        self._usable(kind)
        self._calls += 1
        start = time.perf_counter()
        try:
            work = launch()
            if self._polled:
                # NCCL's wait(timeout) polls for completion sleeping 1 ms between polls
                # (ProcessGroupNCCL's kSynchronizeBusyWaitMillis): up to a millisecond per
                # collective on the communication thread. Poll here at POLL_SECONDS instead;
                # wait() without a timeout then orders the current stream after the
                # collective and raises its error.
                deadline = start + self.timeout
                while not work.is_completed():
                    if time.perf_counter() > deadline:
                        raise TimeoutError(f"no completion within {self.timeout:g} s")
                    time.sleep(POLL_SECONDS)
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as error:
            diagnosis = self._diagnose(kind, error)
            self._broken = (
                f"an earlier collective of this process group failed, so it cannot be used again ({diagnosis})"
            )
            raise GraceCommError(diagnosis) from error
        finally:
            self.traffic.seconds += time.perf_counter() - start

    def fail(self, error: BaseException) -> None:
        """Post this rank's error in the store (where the others' :meth:`_diagnose` reads
        it), then release the process group (:meth:`_release`), so a peer blocked in a
        collective ends now instead of at its timeout; rank 0, which hosts the store, stays
        (bounded) until the others have read the error. A collective that failed here
        (:class:`GraceCommError`) needs neither: its peers' collectives failed or time out
        alike, and aborting a group whose peer is stopped would block."""
        if self._failed or isinstance(error, GraceCommError):
            return
        self._failed = True
        self._broken = (
            f"this rank aborted its process group after its own error ({type(error).__name__}: {str(error)[:200]})"
        )
        store = dist.distributed_c10d._get_default_store()
        text = str(error).splitlines()[0][:300] if str(error) else ""
        try:
            bounded(lambda: store.set(f"{ERROR_KEY}{self._global(self.rank)}", f"{type(error).__name__}: {text}"), 10)
        except Exception:  # best effort: the store may be gone or its host stopped
            pass
        self._release()
        if self._global(self.rank) != 0:
            return  # the store lives on in rank 0's process: nothing to stay for
        try:  # rank 0 hosts the store: stay until the others have read the error
            others = [f"{SEEN_KEY}{self._global(r)}" for r in range(self.size) if r != self.rank]
            seconds = min(self.timeout, 10.0) + DIAGNOSIS_MARGIN
            bounded(lambda: store.wait(others, timedelta(seconds=seconds)), seconds + 5)
        except Exception:  # best effort: the store may be gone already
            pass

    def _release(self) -> None:
        """Abort this engine's process group (and its splits'), so that a peer blocked in a
        collective with this rank fails now: NCCL ends its kernels on abort; gloo closes its
        connections only when the group is freed (abort alone left a peer waiting until this
        process exited, and then its store, in rank 0, went in the same moment as the
        connections: the peer could not read why). So the group is also dropped here: abort
        removes torch's references, this drops the engine's. Bounded: freeing a gloo group
        joins its worker threads, which one of this rank's own collectives may still hold."""
        for engine in self._splits:
            engine._release()
        if self.group is _RELEASED:
            return
        box = [self.group]
        self.group = _RELEASED

        def abort_and_free() -> None:
            group = box.pop()
            try:
                dist.distributed_c10d._abort_process_group(group)
            finally:
                del group  # the last reference: gloo's connections close with it

        try:
            bounded(abort_and_free, 5)
        except Exception:  # best effort: the group may be gone already
            pass

    def _posted_error(self, store: Any) -> str | None:
        """The first error another rank posted with :meth:`fail`, as "rank R failed: …"."""
        for rank in range(self.size):
            key = f"{ERROR_KEY}{self._global(rank)}"
            if rank != self.rank and store.check([key]):
                store.set(f"{SEEN_KEY}{self._global(self.rank)}", "1")
                return f"rank {rank} failed first ({store.get(key).decode()[:300]}); its log has the traceback"
        return None

    def _hold_the_store_for_readers(self, store: Any, patience: float) -> None:
        """On the store's host (global rank 0), having read another rank's posted error: wait
        (bounded) until every other survivor has read it too. Raising at once, the host's
        process could end and take the store with it while a slower survivor (a loaded
        machine) had yet to read why, and that one could only say the store was gone."""
        if self._global(self.rank) != 0:
            return
        for rank in range(self.size):
            glob = self._global(rank)
            if rank == self.rank or store.check([f"{ERROR_KEY}{glob}"]):  # the failed rank reads nothing
                continue
            try:
                store.wait([f"{SEEN_KEY}{glob}"], timedelta(seconds=patience))
            except Exception:  # it left, or reads no more: nothing to hold the store for
                continue

    def _diagnose(self, kind: str, error: BaseException) -> str:
        """Meet the other ranks in the store: a rank that failed on its own left its error
        there (:meth:`fail`); otherwise each survivor sets a key for this collective and
        waits briefly for the others'; those missing did not answer."""
        what = (
            f"{kind} #{self._calls} failed on rank {self.rank} of {self.size} "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        )
        store = dist.distributed_c10d._get_default_store()
        patience = self._patience()
        # the meeting's waits are bounded (patience per rank; the host lingers patience + 5 per
        # rank): only a stopped store host keeps a store call from returning
        others = self.size - 1
        limit = patience * others + 10 + ((patience + 5) * others if self._global(self.rank) == 0 else 0)
        stopped_host = (
            f"{what}; the store (hosted by rank 0) does not answer either: rank 0 is stopped or hung (or "
            "its machine is unreachable): look at rank 0's log"
        )
        try:  # a live store answers at once: a stopped host is told in `patience`, not the meeting's limit
            bounded(lambda: store.check([f"{LEFT_KEY}{self._global(self.rank)}"]), patience)
        except TimeoutError:
            return stopped_host
        except Exception:  # gone, not stopped: the meeting below says which
            pass
        try:
            return bounded(lambda: self._meet_in_store(store, what, patience), limit)
        except TimeoutError:
            return stopped_host
        except Exception as store_error:
            return (
                f"{what}; the store (hosted by rank 0) is unreachable too ({type(store_error).__name__}): rank 0 "
                "stopped or died, or already exited (after an error of its own, or at the end of its loop: "
                f"{UNEVEN_HINT}); this rank cannot tell which: look at rank 0's log"
            )

    def _patience(self) -> float:
        """How long a survivor waits for each other rank at the store meeting. Survivors arrive
        at different times: one sees the dead rank's reset at once, another only when its own
        collective errors or times out, and on a loaded machine later still; so the wait is the
        collective timeout (at most 10 s) plus a margin, and a slow survivor is not blamed (4
        ranks on 2 busy cores missed a 2 s window)."""
        return min(self.timeout, 10.0) + DIAGNOSIS_MARGIN

    def _meet_in_store(self, store: Any, what: str, patience: float) -> str:
        """:meth:`_diagnose`'s meeting: a posted error, else each survivor sets a key for this
        collective and waits ``patience`` for the others'; those missing did not answer."""
        store.set(f"{DIAGNOSING_KEY}{dist.get_rank()}", "1")  # the store's host, leaving, waits for this rank
        posted = self._posted_error(store)
        if posted:
            store.set(f"{LEFT_SEEN_KEY}{dist.get_rank()}", "1")
            self._hold_the_store_for_readers(store, patience)
            return f"{what}; {posted}"
        prefix = f"grace/failed/{self._meeting()}/"
        store.set(prefix + str(self._global(self.rank)), "1")
        missing = []
        for rank in range(self.size):
            if rank == self.rank:
                continue
            if store.check([f"{LEFT_KEY}{self._global(rank)}"]):  # it has left: nothing to wait for
                missing.append(rank)
                continue
            try:
                store.wait([prefix + str(self._global(rank))], timedelta(seconds=patience))
            except Exception as wait_error:
                if "timeout" not in str(wait_error).lower():
                    raise  # not a timeout: the store itself is gone
                missing.append(rank)
        posted = self._posted_error(store)  # a rank that failed while this one waited
        if posted:
            self._hold_the_store_for_readers(store, patience)
            return f"{what}; {posted}"
        self._linger_as_host(store, [r for r in range(self.size) if r != self.rank and r not in missing])
        left = [r for r in missing if store.check([f"{LEFT_KEY}{self._global(r)}"])]
        store.set(f"{LEFT_SEEN_KEY}{dist.get_rank()}", "1")  # the store's host may go now (see _at_exit)
        if left:
            return (
                f"{what}; rank{'s' if len(left) > 1 else ''} {', '.join(map(str, left))} ha"
                f"{'ve' if len(left) > 1 else 's'} left: {'their' if len(left) > 1 else 'its'} process exited "
                f"normally while this rank still exchanged, i.e. it finished its loop first; {UNEVEN_HINT}"
            )
        if missing:
            return (
                f"{what}; rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not "
                f"answer (stopped, hung or dead): look at {'their' if len(missing) > 1 else 'its'} log"
            )
        return f"{what}; every rank is still answering, so the collective itself failed"

    def _meeting(self) -> str:
        """Where this group's survivors meet: one place per process group, not per collective.
        A group fails once (see :meth:`_run`), but not always in the same collective on every
        rank: a survivor whose collective completed before the loss (a ring that had all it
        needed) fails in the next one, and meeting by collective it would blame the other."""
        return f"{self._group_name}:" + "-".join(map(str, (self._global(r) for r in range(self.size))))

    def close(self) -> None:
        """Release the group this engine made for itself (:data:`OWN_GROUP`): gloo's sockets,
        NCCL's communicator. Not collective; the engine cannot exchange afterwards. The subgroups
        :meth:`split` made (hierarchical's nodes and leaders) go with it, whichever group it runs on."""
        for engine in self._splits:
            engine.close()
        self._splits.clear()
        if self.owns_group and self._broken is None:
            self._broken = "its Grace was closed (Grace.close()), and with it the process group it made for itself"
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # best effort: the default group may be destroyed already
                pass
            self.group = _RELEASED

    def _linger_as_host(self, store: Any, answering: list[int]) -> None:
        """Say this rank is done with the store; the rank that hosts it (global rank 0) waits
        (bounded) until the ranks that answered are done too, so that exiting after its own
        error does not make a survivor still waiting for a dead rank blame rank 0."""
        done = f"grace/diagnosed/{self._meeting()}/"
        store.set(done + str(self._global(self.rank)), "1")
        if self._global(self.rank) != 0:
            return
        for rank in answering:
            try:
                store.wait([done + str(self._global(rank))], timedelta(seconds=self._patience() + 5))
            except Exception:  # that rank stopped using the store otherwise: nothing to wait for
                continue

    def allreduce(self, tensor: Tensor) -> Tensor:
        self._count(tensor)
        self._run("allreduce", lambda: dist.all_reduce(tensor, group=self.group, async_op=True))
        return tensor

    def allgather(self, tensor: Tensor, sizes: Sequence[int] | None = None) -> list[Tensor]:
        # torch.distributed gathers equal sizes only: pad to the largest, then trim.
        longest = tensor.numel() if sizes is None else max(sizes)
        if longest == 0:  # every rank is empty: nothing to move, and no rank waits
            return [tensor.new_empty(0) for _ in range(self.size)]
        padded = pad_to(tensor, longest)
        self._count(padded, received=longest * (self.size - 1))
        out = [torch.empty_like(padded) for _ in range(self.size)]
        self._run("allgather", lambda: dist.all_gather(out, padded, group=self.group, async_op=True))
        return out if sizes is None else [o[:n] for o, n in zip(out, sizes)]

    def broadcast(self, tensor: Tensor, root: int) -> Tensor:
        if root == self.rank:
            self._count(tensor, received=0)
        else:
            self._count(tensor.reshape(-1)[:0], received=tensor.numel())  # 0-dim too (a step count)
        self._run("broadcast", lambda: dist.broadcast(tensor, src=self._global(root), group=self.group, async_op=True))
        return tensor

    def all_to_all(self, tensor: Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int]) -> Tensor:
        send, recv, out = self._all_to_all_buffers(tensor, send_sizes, recv_sizes)
        # always a collective, even with nothing to send or receive here: the other ranks may
        # exchange among themselves, and a rank that skipped would meet them in the next one
        self._run(
            "all_to_all",
            lambda: dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=self.group, async_op=True),
        )
        return out

    def split(self, groups: Sequence[Sequence[int]]) -> Engine | None:
        self._usable("split")
        mine = None
        for ranks in groups:  # new_group is collective over the whole default group, in order
            group = dist.new_group([self._global(r) for r in ranks])
            if self.rank in ranks:
                mine = group
        if mine is None:
            return None
        engine = TorchEngine(mine, timeout=self.timeout)
        engine.owns_group = True  # made here for this engine: released by close()
        engine.traffic = self.traffic  # a subgroup's bytes are this rank's bytes
        self._splits.append(engine)
        return engine

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self._usable("broadcast_object")
        box = [obj if self.rank == root else None]
        device = self.control_device if self.backend == "nccl" else None
        dist.broadcast_object_list(box, src=self._global(root), group=self.group, device=device)
        return box[0]

    def barrier(self) -> None:
        self._run("barrier", lambda: dist.barrier(group=self.group, async_op=True))
