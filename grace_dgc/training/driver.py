"""The base of every way in: what drives a :class:`~grace_dgc.grace.Grace` in a training loop.

A way in (the optimizer wrapper, the DDP hook, FSDP's seams, each schedule) claims its Grace,
names the parameters, plans the fusion groups, and *declares* what it keeps, as a
:class:`~grace_dgc.interfaces.Part` declares its settings and state. Everything else follows
from the declarations, written once here: what the ranks compare at the first exchange
(:meth:`Driver.settings`), :meth:`~Driver.state_dict` / :meth:`~Driver.load_state_dict` (with the
refusal of another way in's, other settings' or other shapes' state before anything is loaded),
:meth:`~Driver.stats` and :meth:`~Driver.reset_stats`. A new schedule writes its algorithm and
its declarations, nothing else::

    @register_schedule("every_other")
    class EveryOther(OuterSync):
        SETTINGS = (*OuterSync.SETTINGS, "skip")    # compared across ranks, in the checkpoint
        COUNTERS = (*OuterSync.COUNTERS, "skipped")  # integers a resume goes on from
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import GraceConfigError

if TYPE_CHECKING:
    from ..grace import Grace

FUSION_BYTES = 4 * 2**20  # every way in's default fusion group: up to 4 MiB of gradient per exchange
STATE_FORMAT = 2  # 1: the schedules' before the training wing (read, see _upgrade)
READABLE_FORMATS = (1, 2)


class Coordinator:
    """Where a way in's step (or a schedule's round) begins, and whether it commits: by default
    every rank applies every step. Under torchft (:mod:`grace_dgc.training.torchft`) the
    quorum forms at :meth:`begin` (a group that rejoins takes a healthy peer's state there) and
    the groups vote at :meth:`commit`; a step that does not commit leaves grace's state as it
    was at :meth:`begin`."""

    def begin(self) -> None:
        """Before the step's first exchange (and before the forward pass that feeds it)."""

    def commit(self) -> bool:
        """After the step's exchanges, before anything is applied: apply it (True) or discard it."""
        return True


class Driver:
    """What a way in keeps, declared once (class attributes, each a tuple of attribute names):

    * ``SETTINGS``: the constructor's settings. The ranks compare them at the first exchange
      (with ``HANDSHAKE``'s extra fields) and a checkpoint records them; a resume with other
      values is refused, except those in ``RESUME_MAY_DIFFER`` (name -> why it may).
    * ``COUNTERS``: integers a checkpoint carries (steps, rounds, a policy's next step).
    * ``STATS``: ``{name in stats(): attribute}``, counted since :meth:`reset_stats`; a
      checkpoint carries them (as the Grace carries its own), under the attribute's name
      without ``_stat_``.
    * ``OBJECTS``: objects with a ``state_dict`` of their own (the optimizers); their
      per-parameter tensors are checked against the parameters' shapes before any load.
    * ``TENSORS``: dicts ``{parameter name: tensor}`` (moments, the round's start), checked
      against the parameters' shapes, restored on each parameter's dtype and device.
    * ``PLAIN``: plain data (numbers, strings, tensors in dicts), saved and set back as is,
      before anything else is loaded (a property's setter may convert, or refuse what does
      not fit: FSDP's layout).
    * ``GRACES``: the Graces it drives (the first is the one its stats report), each saved
      with its own ``state_dict``; one that is None is not saved, and a checkpoint that has
      what this run lacks (or lacks what it has) is refused.

    ``KIND`` names the way in in its checkpoint's header (``{KIND: name}``); ``name`` is the
    registered name of a schedule, else the class's. ``PER_RANK``: the state is written under
    a key of this rank's own (as bytes), for ``torch.distributed.checkpoint``, which writes a
    key that every rank has once. ``STATS_PER_GRACE``: :meth:`stats` reports each Grace's
    stats under its name (FSDP's seams) instead of the first Grace's.
    """

    KIND: ClassVar[str] = "wrapper"
    SETTINGS: ClassVar[tuple[str, ...]] = ()
    RESUME_MAY_DIFFER: ClassVar[dict[str, str]] = {}
    COUNTERS: ClassVar[tuple[str, ...]] = ()
    STATS: ClassVar[dict[str, str]] = {}
    OBJECTS: ClassVar[tuple[str, ...]] = ()
    TENSORS: ClassVar[tuple[str, ...]] = ()
    PLAIN: ClassVar[tuple[str, ...]] = ()
    GRACES: ClassVar[tuple[str, ...]] = ("grace",)
    PER_RANK: ClassVar[bool] = False
    STATS_PER_GRACE: ClassVar[bool] = False

    _names: dict[Any, str]  # parameter -> name, in the order the way in exchanges them
    coordinator: Coordinator = Coordinator()  # where a step begins and whether it commits (torchft's sets its own)

    # -- what it is --------------------------------------------------------------------
    preset: str | None = None  # the registered name it was built under (a schedule's Preset)

    @property
    def name(self) -> str:
        return str(self.preset or getattr(type(self), "registered_name", type(self).__name__))

    def settings(self) -> dict[str, Any]:
        """The constructor's settings (``SETTINGS``): what the ranks compare and a checkpoint records."""
        return {key: getattr(self, key) for key in self.SETTINGS}

    def _graces(self) -> list[tuple[str, Grace]]:
        return [(key, getattr(self, key)) for key in self.GRACES if getattr(self, key, None) is not None]

    # -- set-up --------------------------------------------------------------------------
    def _claim(self, grace: Grace, **handshake: Any) -> None:
        """Serve ``grace`` (one way in per Grace: its memory and counters are kept per
        parameter name); the ranks compare this way in's name, settings and ``handshake`` at
        the first exchange."""
        grace.claim(self.name, {"way": self.name, **self.settings(), **handshake})

    @staticmethod
    def _name_parameters(optimizer: torch.optim.Optimizer, named_parameters: Any) -> dict[torch.nn.Parameter, str]:
        """{parameter: name} for ``optimizer``'s trainable parameters, in its order
        (``param.<i>`` without names); duplicate or missing names are refused."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if named_parameters is None:
            return {p: f"param.{i}" for i, p in enumerate(params)}
        named = list(named_parameters)
        names = [n for n, _ in named]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise GraceConfigError(f"named_parameters has duplicate names: {dupes}")
        by_param = {p: n for n, p in named}
        missing = [i for i, p in enumerate(params) if p not in by_param]
        if missing:
            raise GraceConfigError(
                f"named_parameters lacks {len(missing)} of the optimizer's parameters "
                f"(positions {missing[:5]}...); pass model.named_parameters() of the same model"
            )
        return {p: by_param[p] for p in params}

    @staticmethod
    def _fusion_groups(params: Iterable[torch.nn.Parameter], fusion_bytes: int) -> list[list[torch.nn.Parameter]]:
        """Consecutive groups of ``params`` of up to ``fusion_bytes`` each, one dtype and
        device per group (``fusion_bytes=0``: one parameter per group)."""
        groups: list[list[torch.nn.Parameter]] = []
        size = 0
        for param in params:
            nbytes = param.numel() * param.element_size()
            if (
                not groups
                or size + nbytes > fusion_bytes
                or param.dtype != groups[-1][0].dtype
                or param.device != groups[-1][0].device
            ):
                groups.append([])
                size = 0
            groups[-1].append(param)
            size += nbytes
        return groups

    def _plan(self, grace: Grace, groups: Iterable[Iterable[torch.nn.Parameter]]) -> None:
        """Declare one step's fusion groups to ``grace`` (the ranks compare the whole plan at
        the first exchange)."""
        grace.expect_groups([[(self._names[p], p) for p in group] for group in groups])

    def replicas(self) -> dict[str, torch.Tensor]:
        """What is equal on every rank at an exchange ({name: tensor}): the parameters for a way
        in that averages every step; a new quorum compares them across its ranks."""
        return {name: p.detach() for p, name in self._names.items()}

    # -- stats ---------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats` (and the Graces')."""
        for _, grace in self._graces():
            grace.reset_stats()
        for attribute in self.STATS.values():
            setattr(self, attribute, 0)

    def stats(self) -> dict[str, Any]:
        """The first Grace's stats, this way in's ``STATS``, and what :meth:`_more_stats` derives."""
        graces = self._graces()
        if self.STATS_PER_GRACE:
            return {key: grace.stats() for key, grace in graces}
        out = graces[0][1].stats() if graces else {}
        out.update({key: getattr(self, attribute) for key, attribute in self.STATS.items()})
        self._more_stats(out)
        return out

    def _more_stats(self, out: dict[str, Any]) -> None:
        """Figures derived from the others (bytes per synchronization, …), added to ``out``."""

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self, *, peer: bool = False) -> dict[str, Any]:
        """Everything a resumed run needs to go on bit for bit, besides the model's own
        parameters (save ``model.state_dict()`` beside it): the declared state, each Grace's
        and the counters of :meth:`stats`, under a header naming this way in and its settings.
        Plain tensors, numbers and strings: it loads with ``torch.load(..., weights_only=True)``.
        ``peer=True``: for a group that rejoins (torchft), taken off the training thread, so no
        Grace binds (binding exchanges)."""
        self._before_saving()
        state: dict[str, Any] = {"format": STATE_FORMAT, self.KIND: self.name, "settings": self.settings()}
        state.update({key: copy.deepcopy(getattr(self, key)) for key in self.COUNTERS})  # 0/1 Adam's lists too
        state.update({key: getattr(self, key).state_dict() for key in self.OBJECTS})
        state.update({key: {name: t.clone() for name, t in getattr(self, key).items()} for key in self.TENSORS})
        state.update({key: getattr(self, key) for key in self.PLAIN})
        state.update({key: grace.state_dict(bind=not peer) for key, grace in self._graces()})
        state["stats"] = {attr.removeprefix("_stat_"): getattr(self, attr) for attr in self.STATS.values()}
        return self._per_rank(state) if self.PER_RANK else state

    def load_state_dict(self, state_dict: dict[str, Any], *, peer: bool = False) -> None:
        """Restore :meth:`state_dict`'s output. The state of another way in, of other
        settings, of other parameters' shapes or of other Graces is refused with an error
        naming what differs, before anything is loaded. ``peer=True``: the state is a healthy
        peer's, taken by a rank that rejoins (torchft's heal): each Grace keeps of it what is
        equal on every rank (:meth:`Grace.heal`), the rest as saved."""
        state = self._from_rank(state_dict) if self.PER_RANK else state_dict
        if self._load_foreign(state):
            return
        state = self._upgrade(state)
        self._refuse_another(state)
        if not peer:  # a peer's is of the same model (the quorum compares it), and binding would exchange
            self._refuse_other_shapes(state)
        for key in self.PLAIN:  # first: a setter may refuse what does not fit (FSDP's layout)
            if key in state:
                setattr(self, key, state[key])
        for key, grace in self._graces():  # refuse other methods, world sizes, settings
            (grace.heal if peer else grace.load_state_dict)(state[key])
        for key in self.OBJECTS:
            if key in state:
                getattr(self, key).load_state_dict(state[key])
        by_name = {name: p for p, name in self._names.items()}
        for key in self.TENSORS:
            if key in state:
                placed = {n: t.to(by_name[n].device, by_name[n].dtype).clone() for n, t in state[key].items()}
                setattr(self, key, placed)
        for key in self.COUNTERS:
            if key in state:
                setattr(self, key, copy.deepcopy(state[key]))
        saved = state.get("stats", {})  # the counters of stats(), carried as the Graces' are
        for attribute in self.STATS.values():
            setattr(self, attribute, int(saved.get(attribute.removeprefix("_stat_"), getattr(self, attribute))))

    # the hooks of a way in whose state needs more than its declarations
    def _before_saving(self) -> None:
        """Bring the declared state up to date (a schedule's round start, exchanges in flight)."""

    def _load_foreign(self, state: Any) -> bool:
        """Load a state this way in also accepts in another form (the optimizer wrapper: a
        plain optimizer's); True if it did."""
        return False

    # -- what a load checks first ------------------------------------------------------
    def _upgrade(self, state: dict[str, Any]) -> dict[str, Any]:
        """A state of an earlier format in this one's layout: format 1 (the Adam schedules'
        before the training wing) kept its tensors and policy counters in sub-dicts and its
        dense Grace's counters alone."""
        if not isinstance(state, dict) or state.get("format") != 1:
            return state
        state = dict(state)
        state.update(state.pop("tensors", {}))
        state.update(state.pop("counters", {}))
        if "dense_counters" in state and getattr(self, "dense", None) is not None:
            state["dense"] = {**self.dense.state_dict(), "counters": state.pop("dense_counters")}  # type: ignore[attr-defined]
        return state

    def _refuse_another(self, state: Any) -> None:
        """A dict of this way in, this format and these settings (except those that may differ)."""
        graces = [key for key in self.GRACES if getattr(self, key, None) is not None]
        needed = [*self.OBJECTS, *self.TENSORS, *graces]
        headed = isinstance(state, dict) and "format" in state and self.KIND in state
        if headed and state[self.KIND] != self.name:
            raise GraceConfigError(
                f"the state was saved by {self.KIND} {state[self.KIND]!r}; this one is {self.name!r}: "
                f"build the same {self.KIND} to resume"
            )
        if headed:
            needed = ["format", self.KIND, "settings", *needed]
        if not isinstance(state, dict) or any(key not in state for key in needed) or ("format" in state) != headed:
            got = f"keys {sorted(state)[:8]}" if isinstance(state, dict) else type(state).__name__
            raise GraceConfigError(
                f"load_state_dict needs a {self.KIND}'s state_dict() ({self.name}'s: with "
                f"{', '.join(['format', self.KIND, 'settings', *needed[3 if headed else 0 :]])}); got {got}"
            )
        if not headed:  # the optimizer wrapper's and the DDP hook's before the header
            return self._refuse_other_graces(state)
        if state["format"] not in READABLE_FORMATS:
            raise GraceConfigError(
                f"{self.KIND} state format {state['format']!r} is not supported; accepted: "
                f"{', '.join(map(str, READABLE_FORMATS))}"
            )
        saved, mine = state["settings"], self.settings()
        differing = [
            f"{key}: saved {saved.get(key, '(not set)')!r}, this run {mine.get(key, '(not set)')!r}"
            for key in sorted(set(saved) | set(mine))
            if saved.get(key, "(not set)") != mine.get(key, "(not set)") and key not in self.RESUME_MAY_DIFFER
        ]
        if differing:
            raise GraceConfigError(
                f"the state was saved with other settings of {self.KIND} {self.name!r}: {'; '.join(differing)}. "
                "Build with the saved settings to resume"
            )
        self._refuse_other_graces(state)

    def _refuse_other_graces(self, state: dict[str, Any]) -> None:
        for key in self.GRACES:
            has = getattr(self, key, None) is not None
            if has != (key in state):
                raise GraceConfigError(
                    f"the checkpoint {'has' if key in state else 'lacks'} a {key} Grace and this run "
                    f"{'lacks' if not has else 'has'} one: install the same Graces to resume"
                )

    def _refuse_other_shapes(self, state: dict[str, Any]) -> None:
        """Per-parameter tensors of the wrong shape, named: the declared tensors, the
        optimizers' state and what each Grace's parts keep per parameter."""
        shapes = {name: p.shape for p, name in self._names.items()}
        problems = [
            f"{key}[{name!r}]: "
            + ("not in this model" if name not in shapes else f"{tuple(t.shape)} for {tuple(shapes[name])}")
            for key in self.TENSORS
            for name, t in state.get(key, {}).items()
            if name not in shapes or t.shape != shapes[name]
        ]
        problems += [
            f"{key}[{name!r}] missing"
            for key in self.TENSORS
            if key in state and state[key]
            for name in shapes
            if name not in state[key]
        ]
        for key in self.OBJECTS:
            optimizer = getattr(self, key)
            if isinstance(optimizer, torch.optim.Optimizer) and key in state:
                problems += _optimizer_shape_problems(optimizer, state[key], self._names)
        for key, grace in self._graces():
            if isinstance(state.get(key), dict):
                problems += grace.shape_problems(state[key], shapes)
        if problems:
            raise GraceConfigError(
                f"this checkpoint is of a differently shaped model: {'; '.join(problems[:4])}"
                + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
            )

    # -- a key of this rank's own --------------------------------------------------------
    def _rank_key(self) -> str:
        import torch.distributed as dist

        return f"rank{dist.get_rank() if dist.is_initialized() else 0}"

    def _per_rank(self, state: dict[str, Any]) -> dict[str, Any]:
        from .checkpoint import rank_entry

        return rank_entry(self._rank_key(), state)

    def _from_rank(self, state_dict: dict[str, Any]) -> Any:
        from .checkpoint import read_rank_entry

        return read_rank_entry(state_dict, self._rank_key(), f"{self.name} state")


def _optimizer_shape_problems(
    optimizer: torch.optim.Optimizer, saved: Any, names: dict[torch.nn.Parameter, str]
) -> list[str]:
    """Per-parameter tensors of ``saved`` (an optimizer's state_dict, momentum buffers …) whose
    shape is not their parameter's."""
    if not isinstance(saved, dict):
        return []
    params = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [i for group in saved.get("param_groups", []) for i in group.get("params", [])]
    per_param = saved.get("state", {})
    return [
        f"{key} of {names.get(param, index)!r}: {tuple(value.shape)} for {tuple(param.shape)}"
        for index, param in zip(indices, params)
        for key, value in per_param.get(index, {}).items()
        if torch.is_tensor(value) and value.dim() and value.shape != param.shape
    ]
