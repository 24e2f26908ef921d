"""``Grace``: one compressor, one memory and one communicator over one engine.

The whole data path is :meth:`Grace._exchange`, one path for every communicator:

    grad → [prereduce] → compensate → compress → aggregate → memory update → average

``aggregate`` is the communicator's :meth:`~grace_dgc.interfaces.Communicator.aggregate_into`:
exchange and decompress (allreduce, allgather, broadcast; a multi-round method such as
PowerSGD loops through :mod:`grace_dgc.rounds` there), or an aggregating collective
(sparse_allreduce's owners, reduce_scatter's requantized chunks, hierarchical's nodes,
auto's choice). A fusion group of gradients takes the path together: each is compensated,
compressed and remembered on its own, and their payloads share each collective.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any, cast

import torch
from torch import Tensor

from . import handshake, wire
from .engines import AutoEngine
from .engines.base import Engine
from .errors import GraceConfigError, GraceNonFiniteError, check_choice, check_range, on_every_rank
from .interfaces import Communicator, Compressor, Memory, StateMismatch, audit_declarations
from .memories.adaptive import warn_of_error_feedback_under_adam
from .stats import Tally
from .workspace import all_finite, apart, flat_span, outputs_for, shares_storage

NONFINITE_POLICIES = ("skip", "raise")


class Grace:
    """Composes a compressor, a memory and a communicator over an engine (see :func:`build`).

    ``step``/``step_async``/``step_group_async`` run the data path; ``stats()`` reports what
    was measured; ``state_dict()`` carries the compressor's and memory's state.
    """

    #: every exchange runs on the communication thread, also where nothing is left to overlap
    #: (one rank; the step's last group): only to watch the overlap machinery work in a test
    always_thread = False

    def __init__(
        self,
        compressor: Compressor,
        memory: Memory,
        communicator: Communicator,
        engine: Engine,
        nonfinite: str = "skip",
        world_size: int | None = None,
    ) -> None:
        self.compressor = compressor
        self.memory = memory
        self.communicator = communicator
        self.engine = engine
        self.nonfinite = check_nonfinite(nonfinite)
        if world_size is not None:
            check_range("world_size", world_size, 1, kind=int)
        self.expected_world_size = world_size  # checked against the engine's when bound
        self.skipped = 0  # groups skipped for a non-finite gradient (on any rank)
        self._bound = False
        # names of a group -> the layout the ranks agreed on (see handshake), and its dense bytes
        self._agreed: dict[tuple[str, ...], tuple[list[tuple[torch.Size, torch.dtype]], int]] = {}
        self.plan = ""  # every group of one step, when declared (see expect_groups)
        self._driver: tuple[str, dict[str, str]] | None = None  # the way in it serves, and what ranks compare of it
        self.params: dict[str, dict[str, Any]] = {}  # constructor parameters per part, as build() routed them
        self.wire = compressor  # what compresses each gradient: the communicator's choice, set by bind
        self._wire_of = compressor
        self.reset_stats()  # before binding: its handshake is counted (control_*)
        # engine="auto" before any process group exists (a script that builds its parts
        # before init_process_group) waits for the first exchange to choose and bind
        if not isinstance(engine, AutoEngine) or engine.name in ("torch", "horovod"):
            self.bind()
        self._worker: ThreadPoolExecutor | None = None
        self._last_submitted: Future[Any] | None = None  # the latest task handed to the thread
        self._rides = False  # see _prepare
        self._audited = False  # the parts' declarations checked against what they keep
        self._watched: dict[str, Tensor] = {}  # see watch: compared across ranks at the next exchange
        self._watched_optimizer: torch.optim.Optimizer | None = None
        self._resume_route: str | None = None  # see watch: how the way in restores grace's state
        self._loaded_rank: int | None = None  # whose state load_state_dict restored (None: none loaded)
        self._resume_to_check = False  # see handshake.warn_of_a_partial_resume: after watch() or a load

    def close(self) -> None:
        """Finish the exchanges in flight, stop the communication thread and release the
        process group the Grace made for itself (see :func:`build`). A program that builds
        many Graces in one process (ranks kept up across jobs) closes each when done; ``with
        build(...) as grace:`` does it."""
        if self._last_submitted is not None:
            wait([self._last_submitted])
            self._last_submitted = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self.engine.close()

    def __enter__(self) -> Grace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def watch(
        self, params: Mapping[str, Tensor], optimizer: torch.optim.Optimizer | None = None, resume: str | None = None
    ) -> None:
        """The model a wrapper trains: at the next exchange (1) the ranks compare a fingerprint of
        each parameter, and different models are a :class:`GraceConfigError` naming them and the
        fix (``broadcast_parameters``); (2) a resume that restored ``optimizer``'s state but not
        grace's own is warned of once, naming ``resume`` (how to restore it)."""
        self._watched, self._watched_optimizer, self._resume_route = dict(params), optimizer, resume
        self._resume_to_check = True
        if optimizer is not None:
            warn_of_error_feedback_under_adam(self.compressor, self.memory, optimizer)

    def claim(self, way: str, fields: Mapping[str, Any]) -> None:
        """Serve the way in ``way`` (:class:`~grace_dgc.training.driver.Driver` claims its Grace):
        the ranks compare ``fields`` at the first exchange. One way in per Grace: its memory
        and counters are kept per parameter name, and two would mix them."""
        if self._driver is not None:
            raise GraceConfigError(
                f"this Grace already serves {self._driver[0]}; {way} needs one of its own: build one Grace per way "
                "in (its memory and counters are kept per parameter name)"
            )
        self._driver = (way, {key: repr(value) for key, value in fields.items()})

    def attach_optimizer(self, optimizer: torch.optim.Optimizer | None, named_parameters: Mapping[str, Tensor]) -> None:
        """Hand the memory the optimizer (or None) and ``{name: parameter}``
        (:meth:`Memory.attach_optimizer`; the optimizer wrappers and the DDP hook call this)."""
        self.memory.attach_optimizer(optimizer, dict(named_parameters))

    def expect_groups(self, groups: Sequence[Sequence[tuple[str, Tensor]]]) -> None:
        """Declare the fusion groups of one step, in order, as (name, tensor) pairs: the
        ranks compare the whole plan at the next handshake, so a rank with one more (or one
        other) group is a :class:`GraceConfigError` on every rank before any exchange of it
        (DistributedOptimizer declares its buckets)."""
        self.plan = repr([handshake.tensor_list([n for n, _ in group], [t for _, t in group]) for group in groups])
        self._agreed.clear()  # the next group's first exchange checks the plan

    # -- the data path -------------------------------------------------------------
    def step(self, tensor: Tensor, name: str) -> Tensor:
        """Exchange one gradient; returns the average every rank agrees on."""
        return self.step_async(tensor, name).result()

    def step_async(self, tensor: Tensor, name: str) -> Future[Tensor]:
        """Start :meth:`step` on the communication thread; returns a Future of the average."""
        group, single = self.step_group_async([tensor], [name]), Future()  # type: ignore[var-annotated]
        fail, done = single.set_exception, single.set_result
        group.add_done_callback(lambda g: fail(g.exception()) if g.exception() else done(g.result()[0]))
        return single

    def step_group_async(
        self,
        tensors: Sequence[Tensor],
        names: Sequence[str],
        inplace: bool = False,
        finite: bool = False,
        span: Tensor | None = None,
        overlap: bool = True,
    ) -> Future[list[Tensor]]:
        """Exchange a fusion group: each tensor is compressed (and remembered) on its own,
        their payloads travel together (one size exchange and one data collective per round).
        Returns a Future of the list of averages.

        ``inplace=True`` hands the tensors over (gradient buffers the caller overwrites with
        the averages anyway): the averages are written into them and the returned list holds
        the tensors themselves, and the exchange may sum them where they lie. Otherwise the
        inputs are left untouched and the averages are new tensors.

        Groups run one at a time in submission order, so ranks that submit the same groups
        in the same order issue matching collectives. ``finite=True``: the caller asked
        :meth:`nonfinite_ranks` (every rank alike) and none holds a NaN/Inf: no flag exchange.
        ``span``: with ``inplace=True``, the flat tensor the tensors are, back to back (a
        fusion bucket's buffer). ``overlap=False``: nothing is left to overlap (the step's last
        group): it runs on the caller's thread after the groups before it (:meth:`run_in_order`).
        """
        ready = None
        if any(t.is_cuda for t in tensors):  # the gradients are produced on the caller's stream
            ready = torch.cuda.Event()
            ready.record()
        return self.run_in_order(
            partial(self._exchange_or_fail, list(tensors), list(names), inplace, ready, finite, span), overlap
        )

    def run_in_order(self, fn: Any, overlap: bool = True) -> Future[Any]:
        """Run ``fn()`` on the communication thread after the groups submitted before it (a
        collective of the caller's own stays in order with grace's on every rank); on the
        caller's thread where nothing is left to overlap (one rank, ``overlap=False``): the
        hand-off costs more than a small exchange (the DDP hook on one rank: 1.29× DDP's step
        on the thread, 1.16× inline). The caller's time held here is its ``wait_seconds``."""
        if not self.always_thread and (self.engine.size == 1 or not overlap):
            started = time.perf_counter()
            if self._last_submitted is not None:  # the groups before it go first, on the thread
                wait([self._last_submitted])
                self._last_submitted = None
            done: Future[Any] = Future()
            try:
                done.set_result(fn())
            except BaseException as error:
                done.set_exception(error)
            self.tally.wait_seconds += time.perf_counter() - started  # the caller was held all along
            return done
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grace-comm")
        self._last_submitted = self._worker.submit(fn)
        return self._last_submitted

    def _exchange_or_fail(
        self,
        tensors: list[Tensor],
        names: list[str],
        inplace: bool,
        ready: Any,
        finite: bool = False,
        span: Tensor | None = None,
    ) -> list[Tensor]:
        """:meth:`_exchange`; an error that this rank alone meets (a bug, a bad view, a
        collective that failed) is handed to the engine, which tells the other ranks and
        wakes them from the collective they wait in: every rank gets a named error now,
        instead of one error here and a timeout there."""
        try:
            averages = self._exchange(tensors, names, inplace, ready, finite, span)
            if ready is not None:
                # the averages (a NaN fill of a skip, a copy back into a non-contiguous input
                # included) are complete before the Future is: its consumer may read them on
                # any stream of any thread. The finiteness check already waited for the
                # exchange, so this costs no extra wait on the GPU.
                torch.cuda.current_stream(tensors[0].device).synchronize()
            return averages
        except BaseException as error:
            if not getattr(error, "on_every_rank", False):
                self.engine.fail(error)
            raise

    def _exchange(
        self,
        tensors: list[Tensor],
        names: list[str],
        inplace: bool = False,
        ready: Any = None,
        finite: bool = False,
        span: Tensor | None = None,
    ) -> list[Tensor]:
        """The data path of one fusion group (module docstring). The averages land in the
        inputs when they are handed over (a non-contiguous one through a temporary), else in
        new tensors; a NaN/Inf on any rank skips the group alike on every rank."""
        if ready is not None:
            torch.cuda.current_stream(tensors[0].device).wait_event(ready)
        dense_bytes = self._prepare(tensors, names)
        comp, memory, comm = self.wire, self.memory, self.communicator
        if not (self._rides or finite):  # ranks learn of a NaN/Inf before any state changes (one allgather)
            bad = self._nonfinite_ranks(tensors)
            if bad:
                return self._skip(tensors, outputs_for(tensors, inplace), names, inplace, bad)
        sources, keys, outputs, consume = self._sources(tensors, names, inplace, span)
        guard = self._guard(tensors, keys)
        with self.tally.clock.running():
            with self.tally.communicating(self.engine):  # hierarchical: the node's sum
                sources = comm.prereduce(sources, keys)  # (auto: an owner's stranded error folded in)
            if memory.identity:  # compensate returns its input, update and decode_average do nothing
                compensated = sources
            else:
                with self.tally.clock.timed("memory"):
                    compensated = [memory.compensate(t, n) for t, n in zip(sources, keys)]
            if comp.prerounds:  # e.g. THC's scale, agreed over ranks before anyone compresses
                with self.tally.communicating(self.engine):
                    comp.preround(compensated, keys, self.engine)
            with self.tally.clock.timed("compress"):
                payloads, ctxs = map(list, zip(*(comp.compress(c, n) for c, n in zip(compensated, keys))))
            consume = consume and not shares_storage(payloads, tensors, inplace)
            if not memory.identity:
                outputs = [apart(out, c, memory) for out, c in zip(outputs, compensated)]
            with self.tally.communicating(self.engine):
                sent, sent_ctxs = comm.aggregate_into(comp, payloads, ctxs, keys, outputs, consume)
            if not memory.identity:
                with self.tally.clock.timed("memory"):
                    for c, n, payload, ctx in zip(compensated, keys, sent, sent_ctxs):
                        memory.update(c, n, comp, payload, ctx)
            if comp.average and self.engine.size > 1:  # x / 1 is x: no pass over memory for it
                for out in outputs:
                    out.div_(self.engine.size)
            if not memory.identity:
                with self.tally.clock.timed("memory"):  # EF21: the shared estimate plus the averaged change
                    for out, n in zip(outputs, keys):
                        memory.decode_average(out, n)
        return self._finish(tensors, outputs, names, keys, inplace, guard, dense_bytes)

    def _prepare(self, tensors: list[Tensor], names: list[str]) -> int:
        """Before a group's exchange: bind at the first one, agree with the other ranks on a
        group not seen before, follow a compressor or memory assigned after binding. Returns
        the group's dense (fp32) bytes."""
        if not self._bound:
            self.bind()
        # keyed by the names (strings hash once), the shapes compared: runs every group, every step
        key, layout = tuple(names), [(t.shape, t.dtype) for t in tensors]
        agreed = self._agreed.get(key)
        if agreed is None or agreed[0] != layout:  # first exchange of this group: do ranks agree?
            with self.tally.controlling(self.engine):
                handshake.agree(self, tensors, names)
            agreed = self._agreed[key] = (layout, 4 * sum(t.numel() for t in tensors))
        if self._watched:  # once, before anything is stepped: the same model on every rank?
            watched, self._watched = self._watched, {}
            with self.tally.controlling(self.engine):
                handshake.agree_replicas(self.engine, watched, tensors[0].device)
        if self._resume_to_check:  # once after watch() or a load: what was (not) restored
            self._resume_to_check = False
            handshake.warn_of_a_partial_resume(self)
        if self._wire_of is not self.compressor:
            self.wire, self._wire_of = self.communicator.wire_compressor(self.compressor), self.compressor
        # a NaN/Inf rides along in a plain sum to every rank when nothing keeps state
        self._rides = self.memory.identity and self.wire.rounds == 1 and self.communicator.propagates_nonfinite
        if not self._audited and self.tally.values["groups"]:  # the parts' state exists by now
            self._audited = True
            audit_declarations(self._parts())
        return agreed[1]

    def _sources(
        self, tensors: list[Tensor], names: list[str], inplace: bool, span: Tensor | None = None
    ) -> tuple[list[Tensor], list[str], list[Tensor], bool]:
        """What gets compressed, under which names, into which outputs, and whether the
        payloads may be consumed by an in-place reduction (nothing reads a single-round
        payload afterwards when the memory is the identity). A handed-over fusion bucket of
        an elementwise method is compressed, reduced and decompressed as its flat buffer.
        Parts always see contiguous tensors: a strided or channels_last gradient (a
        convolution's) is copied once here, so no compressor, memory or chunking view fails
        on its strides (its average goes back in its own layout, :meth:`_finish`)."""
        consume = self.wire.rounds == 1 and self.memory.identity
        if inplace and consume and self.wire.elementwise and len(tensors) > 1:
            flat = span if span is not None else flat_span(tensors)
            if flat is not None:
                return [flat], [names[0] + "…"], [flat], consume
        return [wire.dense(t) for t in tensors], names, outputs_for(tensors, inplace), consume

    def _guard(self, tensors: list[Tensor], keys: list[str]) -> dict[str, dict[str, Any]] | None:
        """A finite gradient may still overflow on the wire (fp16: beyond ±65504): then the
        state this step changes (memory, owner errors, the compressor's own: PowerSGD's Q) is
        copied first, so a skipped step leaves it bitwise as it was."""
        if self._rides or not (self.wire.may_overflow or any(t.dtype == torch.float16 for t in tensors)):
            return None
        return {kind: part.snapshot(keys) for kind, part in self._parts()}

    def _finish(
        self,
        tensors: list[Tensor],
        outputs: list[Tensor],
        names: list[str],
        keys: list[str],
        inplace: bool,
        guard: dict[str, dict[str, Any]] | None,
        dense_bytes: int,
    ) -> list[Tensor]:
        """Count the group, catch a non-finite average, and hand the averages back."""
        self.tally.group(names, dense_bytes)
        # every rank holds the same average, so all see this alike: a NaN/Inf that rode along,
        # or a payload that overflowed (fp16 beyond ±65504) after the inputs passed the check
        if not all_finite(outputs):
            for kind, part in self._parts():
                if guard is not None:  # the state as it was before this step
                    part.restore(guard[kind], keys)
                elif not self._rides:  # an fp32 sum beyond 3.4e38: the state saw the overflow, forget it
                    for key in keys:
                        part.reset(key)
            return self._skip(tensors, outputs, names, inplace, None)
        if not inplace:
            return outputs
        for tensor, out in zip(tensors, outputs):
            if out is not tensor and len(outputs) == len(tensors):
                tensor.copy_(out)
        return list(tensors)

    def nonfinite_ranks(self, tensors: Sequence[Tensor]) -> list[int]:
        """The ranks whose ``tensors`` hold a NaN or an infinity, the same list on every rank
        (one small allgather, in order with the exchanges): a schedule that exchanges several
        groups for one step asks first, so that all of them are skipped or none."""
        if not self._bound:
            self.bind()
        return self.run_in_order(partial(self._nonfinite_ranks, list(tensors))).result()

    def _nonfinite_ranks(self, tensors: list[Tensor]) -> list[int]:
        """Ranks whose gradients hold a NaN or an infinity (the same list on every rank)."""
        mine = 0.0 if all_finite(tensors) else 1.0
        if self.engine.size == 1:
            return [0] if mine else []
        with self.tally.controlling(self.engine):
            flags = self.engine.allgather(torch.tensor([mine], device=tensors[0].device))
        return [rank for rank, flag in enumerate(flags) if float(flag[0])]

    def _skip(
        self, tensors: list[Tensor], outputs: list[Tensor], names: list[str], inplace: bool, ranks: list[int] | None
    ) -> list[Tensor]:
        """A gradient of this group is not finite on some rank: every rank skips it alike.
        Memories and compressors are left as they were (``rides``: the identity memory
        keeps nothing); the averages are NaN, so the step is skipped by
        ``DistributedOptimizer`` and found by ``torch.amp.GradScaler``; ``nonfinite="raise"``
        raises instead."""
        where = "some rank" if ranks is None else f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        if self.nonfinite == "raise":
            raise on_every_rank(GraceNonFiniteError(f"a gradient of {shown} is not finite (NaN or Inf) on {where}"))
        self.skipped += 1
        self.tally.values["skipped"] += 1
        for target in tensors if inplace else outputs:
            target.fill_(float("nan"))
        return list(tensors) if inplace else outputs

    def bind(self) -> None:
        """Hand the engine to the parts that need the world size (fp16's pre-division,
        momentum's clipping): when built, or at the first exchange with ``engine="auto"``."""
        if self.expected_world_size is not None and self.engine.size != self.expected_world_size:
            raise GraceConfigError(
                f"built for world_size={self.expected_world_size} but the {self.engine.name} "
                f"engine has {self.engine.size} ranks"
            )
        with self.tally.controlling(self.engine):
            handshake.agree_settings(self)  # before set-up runs collectives that depend on them
        parts_engine = self.communicator.setup()
        self.wire = self.communicator.wire_compressor(self.compressor)
        self._wire_of = self.compressor
        self.wire.bind(parts_engine)
        self.memory.bind(parts_engine)
        self._bound = True

    @property
    def world_size(self) -> int:
        """The number of ranks (GRACE scripts read ``grace.world_size``, some before
        ``init_process_group``: then the one given to :func:`build`, checked when bound)."""
        if not self._bound and self.expected_world_size is not None:
            return self.expected_world_size
        return self.engine.size

    @property
    def rank(self) -> int:
        return self.engine.rank

    def set_epoch(self, epoch: int) -> None:
        """Tell schedule-driven parts (e.g. DGC's warm-up) the current epoch."""
        for part in (self.compressor, self.memory, self.communicator):
            part.set_epoch(epoch)

    # -- stats -----------------------------------------------------------------
    def reset_stats(self) -> None:
        self.tally = Tally()

    def counters(self) -> dict[str, Any]:
        """What :meth:`stats` counts since the last :meth:`reset_stats`, as plain numbers:
        :meth:`state_dict` carries them, so a resumed run's stats (and a trainer's logs) go on
        from the saved figures instead of restarting at 0."""
        return self.tally.counters()

    def load_counters(self, saved: Mapping[str, Any]) -> None:
        """Restore :meth:`counters` (keys this version does not count are left out)."""
        self.tally.load(saved)

    def add_wait(self, seconds: float) -> None:
        """Charge ``seconds`` the training thread spent blocked on this Grace's exchanges
        (the optimizer wrappers call it; reported as ``wait_seconds``)."""
        self.tally.wait_seconds += seconds

    def stats(self) -> dict[str, Any]:
        """Counters since the last :meth:`reset_stats` (all measured, none assumed).

        steps: exchanges of the most-exchanged tensor name (= optimizer steps);
        tensors, groups: tensors exchanged, and fusion groups (each one set of collectives);
        bytes_sent: bytes this rank handed to collectives as its own contribution to the
        payloads' exchanges, padding and the payloads' size headers included; bytes_received:
        bytes it got back from the other ranks
        (allgather: every other rank's buffer, so it grows with the world size; see
        :class:`~grace_dgc.engines.base.Engine`); dense_bytes: what an fp32 allreduce of the
        same tensors would hand over;
        compression_ratio: bytes_sent / dense_bytes (0.001 = a thousandth is sent);
        ``<phase>_seconds``: time in each phase of the data path, on the thread that ran it;
        wait_seconds: time the training thread spent blocked on exchanges still in flight
        (DistributedOptimizer.synchronize), the communication that backward did not hide;
        control_bytes_sent, control_bytes_received, control_seconds: the ranks' agreements
        around the payloads (the settings and fingerprint handshakes, the non-finite flags),
        counted apart so that bytes_sent stays what the method's wire format says.
        """
        out = self.tally.figures()
        for part in (self.compressor, self.memory, self.communicator):  # e.g. DGC's ratio, auto's choices
            out.update(part.stats())
        return out

    # -- settings and checkpointing -----------------------------------------------
    STATE_FORMAT = handshake.STATE_FORMAT

    def settings(self) -> dict[str, Any]:
        """What the ranks compare (see :mod:`~grace_dgc.handshake`) and a checkpoint records:
        each part's name and declared settings (as ``repr`` text), the non-finite policy and
        the settings of the way in it serves (:meth:`claim`)."""
        names = self._methods()
        out: dict[str, Any] = {
            kind: {
                "name": names[kind],
                "settings": {key: repr(value) for key, value in part.agreed_settings().items()},
            }
            for kind, part in self._parts()
        }
        out["nonfinite"] = self.nonfinite
        out["way_in"] = self._driver[1] if self._driver else {}
        return out

    def state_dict(self, bind: bool = True) -> dict[str, Any]:
        """The compressor's, memory's and communicator's state (copies), with what it belongs
        to: the format version, the three method names, the world size and the settings; and
        the :meth:`counters` of :meth:`stats`, which a resumed run goes on from.
        Plain tensors, numbers, strings and containers only: it loads with
        ``torch.load(..., weights_only=True)``."""
        if bind and not self._bound:  # bind=False: off the training thread (a peer's heal), no exchange
            self.bind()  # set-up makes the state some communicators keep (hierarchical's outer)
        settings = self.settings()
        return {
            "format": self.STATE_FORMAT,
            "methods": self._methods(),
            "world_size": self.world_size,
            "rank": self.rank,  # per-rank state: a resume on another rank is warned about
            "settings": {kind: settings[kind]["settings"] for kind, _ in self._parts()},
            "compressor": self.compressor.state_dict(),
            "memory": self.memory.state_dict(),
            "communicator": self.communicator.state_dict(),
            "counters": self.counters(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output. A state of other methods or another world
        size is refused with an error naming both (per-rank state such as residuals has no
        meaning on a different number of ranks); a state without the header (grace_dgc 0.1)
        loads as before."""
        handshake.refuse_another_state(self, state)  # other methods, world sizes, settings: named, before any load
        if not self._bound:
            self.bind()  # the parts' state exists once they are set up
        try:
            # the communicator first: it may refuse a state of another configuration before
            # anything is loaded
            self.communicator.load_state_dict(state.get("communicator", {}))
            self.compressor.load_state_dict(state["compressor"])
            self.memory.load_state_dict(state["memory"])
            self._loaded_rank = state.get("rank", self.rank)
            self._resume_to_check = True  # another rank's state is warned of at the next exchange
            if "counters" in state:  # a state saved before counters were carried leaves them as they are
                self.load_counters(state["counters"])
        except (KeyError, TypeError, AttributeError, StateMismatch) as error:
            raise GraceConfigError(
                f"the state does not fit {handshake.describe_methods(self._methods())} ({type(error).__name__}: "
                f"{error}); was it saved by another method?"
            ) from error

    def heal(self, peer: dict[str, Any]) -> None:
        """Take a healthy peer's :meth:`state_dict` as a rank that rejoins (torchft): what every
        rank holds alike (``Part.REPLICATED``) and the counters; the rest starts empty."""
        try:
            handshake.refuse_another_state(self, peer, healing=True)
        except GraceConfigError as error:
            raise GraceConfigError(f"a group that rejoins must be built as its healthy peers are: {error}") from None
        for kind, part in self._parts():
            part.heal(peer[kind])
        self.load_counters(peer.get("counters", {}))

    def ranks_changed(self, replicas: Mapping[str, Tensor]) -> None:
        """The ranks are others (a new quorum): bind and agree again, forget what held only for
        the old ranks, and compare ``replicas`` across the new ones (at the next exchange)."""
        self._bound, self._watched = False, dict(replicas)
        self._agreed.clear()
        for _, part in self._parts():
            part.ranks_changed()

    def shape_problems(self, state: dict[str, Any], shapes: dict[str, torch.Size]) -> list[str]:
        """What in a saved :meth:`state_dict` does not fit tensors of ``shapes`` (name ->
        shape): each part answers for its own state, as it declares it (binds first: a
        communicator's state exists once it is set up)."""
        if not self._bound:
            self.bind()
        problems = []
        for kind, part in self._parts():
            problems += part.shape_problems(state.get(kind), shapes, f"grace[{kind!r}]")
        return problems

    def _parts(self) -> tuple[tuple[str, Any], ...]:
        return (("compressor", self.compressor), ("memory", self.memory), ("communicator", self.communicator))

    def _methods(self) -> dict[str, str]:
        return {kind: getattr(part, "registered_name", type(part).__name__) for kind, part in self._parts()}

    def __repr__(self) -> str:
        return (
            f"Grace(compressor={self.compressor.registered_name!r}, "
            f"memory={self.memory.registered_name!r}, "
            f"communicator={self.communicator.registered_name!r}, engine={self.engine.name!r})"
        )


def check_nonfinite(policy: str) -> str:
    return cast(str, check_choice("nonfinite", policy, NONFINITE_POLICIES))
