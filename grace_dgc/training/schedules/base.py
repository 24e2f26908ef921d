"""What every schedule shares: a wrapped optimizer, its parameters in fusion groups, and
exchanges of something other than the gradient (an outer gradient, a momentum) through a Grace."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from ...errors import GraceConfigError, check_range
from ..optimizer import WrappingOptimizer

if TYPE_CHECKING:
    from ...grace import Grace

Fill = Callable[[torch.nn.Parameter, Tensor], object]  # writes what a parameter sends into a buffer
Filled = tuple[list[torch.nn.Parameter], Tensor, list[Tensor]]  # a fusion group, its flat buffer, its views
Pending = list[tuple[list[torch.nn.Parameter], Future[list[Tensor]]]]
Named = Iterable[tuple[str, torch.nn.Parameter]] | None  # model.named_parameters(), or None: param.<i>


class Schedule(WrappingOptimizer):
    """A schedule: it decides *when* and *what* its Grace exchanges, and owns the step."""

    KIND = "schedule"
    RESUME_MAY_DIFFER: ClassVar[dict[str, str]] = {
        "fusion_bytes": "fusion only batches the exchange; what is kept is kept per parameter name"
    }

    def _wrap(self, optimizer: torch.optim.Optimizer, grace: Grace, named_parameters: Named, fusion_bytes: int) -> None:
        """Keep the optimizer and the Grace, name the trainable parameters and plan their fusion
        groups (``self._groups``). Deliberately no ``Optimizer.__init__``: the wrapped optimizer
        owns the parameter groups and the state."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise GraceConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.fusion_bytes = check_range("fusion_bytes", fusion_bytes, 0, kind=int)
        self.optimizer, self.grace = optimizer, grace
        self._names = self._name_parameters(optimizer, named_parameters)
        if not self._names:
            raise GraceConfigError(f"{self.name}: the optimizer has no trainable parameters (requires_grad=True)")
        self._groups = self._fusion_groups(list(self._names), self.fusion_bytes)

    def _fill(self, groups: list[list[torch.nn.Parameter]], fill: Fill) -> Iterator[Filled]:
        """Each group's tensors, written by ``fill(p, out)`` into views of one flat buffer
        (elementwise methods without memory then reduce a group in one collective), lazily:
        a group is filled as the one before it is on its way."""
        with torch.no_grad():
            for group in groups:
                flat = torch.empty(sum(p.numel() for p in group), dtype=group[0].dtype, device=group[0].device)
                views = [view.view_as(p) for p, view in zip(group, flat.split([p.numel() for p in group]))]
                for p, view in zip(group, views):
                    fill(p, view)
                yield group, flat, views

    def _send_groups(self, grace: Grace, filled: Iterable[Filled], **options: Any) -> Pending:
        """Hand each filled group to ``grace`` (averaged in place, on its communication thread)."""
        with torch.no_grad():
            return [
                (group, grace.step_group_async(views, [self._names[p] for p in group], inplace=True, **options))
                for group, _, views in filled
            ]

    @staticmethod
    def _wait(grace: Grace, pending: Pending) -> dict[torch.nn.Parameter, Tensor]:
        """The averages of ``pending``, per parameter; the time the training thread blocks on
        them is the Grace's wait."""
        waiting = time.perf_counter()
        try:
            averages = {p: average for group, future in pending for p, average in zip(group, future.result())}
        except BaseException:  # the groups after it still run: none may change state once the step is judged
            wait([future for _, future in pending])
            raise
        finally:
            grace.add_wait(time.perf_counter() - waiting)
        return averages

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.begins_a_step():  # torchft: the quorum forms before the forward pass (a heal lands here)
            self.coordinator.begin()
        return self.optimizer.zero_grad(set_to_none=set_to_none)

    def begins_a_step(self) -> bool:
        """Does the coming step begin a step of the coordinator's (torchft's quorum)? Each schedule
        says where its exchanges' steps begin; by default every step."""
        return True

    def __repr__(self) -> str:
        listed = ", ".join(f"{key}={value!r}" for key, value in self.settings().items())
        return f"{type(self).__name__}({self.optimizer!r}, {self.grace!r}, {listed})"
