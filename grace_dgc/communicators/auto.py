from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from ..costmodel import collective_steps, wire_bytes
from ..errors import check_range
from ..interfaces import Communicator, Compressor, Ctxs, Payloads, Sent, Tensors
from ..registry import COMMUNICATORS, register_communicator
from .chunked import Chunked
from .switch import Switch, SwitchContext

CANDIDATES = ("allreduce", "allgather", "sparse_allreduce", "reduce_scatter")


def candidates() -> tuple[str, ...]:
    """auto's members: the built-in exchanges above, then every plugin communicator (one not
    defined in grace_dgc) that declares its cost (:meth:`Communicator.cost`), by name — the same
    list, and so the same index for each choice, on every rank that loaded the same plugins."""
    plugins = sorted(
        name
        for name in COMMUNICATORS.names()
        if not COMMUNICATORS.get(name).__module__.startswith("grace_dgc.")
        and COMMUNICATORS.get(name).cost(2, 1.0, 1.0) is not None
    )
    return CANDIDATES + tuple(plugins)


def predict(name: str, n: int, payload: float, dense: float, alpha: float, beta: float) -> float:
    """Seconds the α-β model gives one bucket's exchange on ``n`` ranks (wire time only):
    α per collective step, β per byte on this rank's busiest direction. ``payload`` is one
    rank's compressed bytes, ``dense`` the bucket's fp32 bytes. The formulas are those of
    :mod:`grace_dgc.costmodel`, shared with ``grace-dgc project``."""
    return alpha * collective_steps(name, n) + beta * wire_bytes(name, n, payload, dense)


@register_communicator("auto")
class Auto(Communicator):
    """Per fusion bucket, the cheapest communicator under the α-β cost model, re-decided as it runs

    As Espresso (Wang et al. 2023) chooses per tensor: among those that can carry the
    compressor (allreduce, allgather, sparse_allreduce, reduce_scatter, and any plugin
    communicator that declares its cost: :func:`candidates`).

    For bucket b with payload p_b bytes per rank (measured), dense size d_b, on N ranks:

        T_c(b) = α·steps_c(N) + β·bytes_c(N, p_b, d_b) + (measured seconds of b under c
                 outside collectives: compress, decompress, sums)

    ``bandwidth`` (bytes/s) and ``latency`` (s) are given, or measured once at set-up
    (a small and a 4 MiB allreduce, three times each, the minimum). The first ``probe``
    steps of a bucket try each candidate in turn (measuring payload and compute), then rank
    0 decides for every rank (a broadcast, so all run the same collective), and decides
    again every ``interval`` steps from the running figures. ``grace.stats()["auto"]`` shows
    each bucket's choice and predicted seconds.

    State: the plan (choices, each bucket's figures, the link used) and the members' own
    state. When a bucket leaves ``reduce_scatter``, the errors its owners carried are not
    left behind: each owner adds its ε (times N for averaging methods, so the average
    carries ε) to its own gradient's chunk before the next exchange (:meth:`prereduce`),
    where the memory keeps whatever of it the compressor does not send.
    """

    SETTINGS = ("bandwidth", "latency", "interval")
    STATE = ("choice", "buckets", "link", "members")
    REPLICATED = ("choice", "link")  # rank 0's plan, broadcast (each rank times its own buckets)

    def __init__(
        self, engine: Any, bandwidth: float | None = None, latency: float | None = None, interval: int = 200
    ) -> None:
        super().__init__(engine)
        self.bandwidth = None if bandwidth is None else check_range("bandwidth", bandwidth, 0, low_open=True)
        self.latency = None if latency is None else check_range("latency", latency, 0)
        self.interval = check_range("interval", interval, 1, kind=int)
        self.choice: dict[str, str] = {}  # tensor name -> communicator of its bucket
        self.buckets: dict[tuple[str, ...], dict[str, Any]] = {}
        self.link = {"latency": latency, "bandwidth": bandwidth}  # in use: given, or measured at set-up
        self.members: dict[str, Communicator] = {}
        self.candidates = candidates()

    def agreed_settings(self) -> dict[str, Any]:
        # the candidates' order is the code of every plan rank 0 broadcasts: a rank that loaded
        # other plugins would read the codes as other communicators
        return {**super().agreed_settings(), "candidates": self.candidates}

    @classmethod
    def refusal(cls, compressor: Compressor) -> str | None:
        if compressor.rounds > 1 or compressor.prerounds:  # its members would not agree first
            return super().refusal(compressor)
        return None  # allgather carries every single-round compressor

    def setup(self) -> Any:
        self.members = {name: COMMUNICATORS.get(name)(self.engine) for name in self.candidates}
        # a node's other ranks under hierarchical follow their leader's plan: no link to measure
        if (self.bandwidth is None or self.latency is None) and self.engine.collectives:
            self._measure_link()
        return self.engine

    def prereduce(self, tensors: list[Tensor], names: list[str]) -> list[Tensor]:
        """Fold the owner errors of tensors whose bucket left ``reduce_scatter`` into this
        rank's gradient (out of place): the error is sent by the next exchange instead of
        being stranded in an idle member."""
        errors: dict[str, Tensor] = getattr(self.members.get("reduce_scatter"), "errors", {})
        if not errors:
            return tensors
        folded, me = list(tensors), self.engine.rank
        scale = self.engine.size if self.plain.average else 1
        for i, name in enumerate(names):
            if name in errors and self.choice.get(name, self._default()) != "reduce_scatter":
                carried = errors.pop(name)
                bounds = self.chunked.bounds(tensors[i].numel())
                flat = tensors[i].reshape(-1).clone()
                flat[bounds[me] : bounds[me + 1]].add_(carried.to(flat.dtype), alpha=scale)
                folded[i] = flat.view(tensors[i].shape)
        return folded

    def _measure_link(self) -> None:
        device = self.engine.control_device  # NCCL probes its own link, on the GPU

        def timed(numel: int) -> float:
            buffer = torch.zeros(numel, device=device)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                self.engine.allreduce(buffer)
                if device.type == "cuda":  # the collective is queued on the GPU: wait for it
                    torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - start)
            return best

        traffic = (self.engine.traffic.sent, self.engine.traffic.received)
        small, large = timed(1), timed(1 << 20)
        self.engine.traffic.sent, self.engine.traffic.received = traffic  # set-up is not training traffic
        n = max(self.engine.size, 2)
        measured = torch.tensor([small, max(large - small, 1e-9) / (2 * (n - 1) / n * 4 * (1 << 20))], device=device)
        measured = self.engine.broadcast(measured, 0)  # rank 0's figures, so all decide alike
        if self.latency is None:
            self.link["latency"] = float(measured[0]) / max(2 * (n - 1), 1)
        if self.bandwidth is None:
            self.link["bandwidth"] = 1 / float(measured[1])

    def wire_compressor(self, compressor: Compressor) -> Compressor:
        self.plain = compressor
        self.chunked = Chunked(compressor, self.engine.size)
        self.fitting = [c for c in self.candidates if COMMUNICATORS.get(c).fits(compressor)]
        return Switch(self)

    def aggregate_into(
        self, comp: Compressor, payloads: Payloads, ctxs: Ctxs, names: list[str], outs: Tensors, consume: bool = False
    ) -> Sent:
        key = tuple(names)
        bucket = self.buckets.setdefault(key, {"steps": 0, "seen": {}, "chosen": None})
        chosen = self.choice.get(names[0], self._default())
        member = self.members[chosen]
        start, waited = time.perf_counter(), self.engine.traffic.seconds
        inner = self.chunked if chosen == "reduce_scatter" else self.plain
        sent, sent_ctxs = member.aggregate_into(inner, payloads, [c.ctx for c in ctxs], names, outs)
        # local compute: compress, and the exchange's time outside collectives (decompress, sums)
        waited = self.engine.traffic.seconds - waited
        seconds = time.perf_counter() - start - waited + sum(c.seconds for c in ctxs)
        payload_bytes = sum(t.numel() * t.element_size() for p in payloads for t in p)
        bucket["seen"][chosen] = (payload_bytes, seconds, sum(o.numel() * 4 for o in outs))
        bucket["steps"] += 1
        self._decide(key, bucket)
        return sent, [SwitchContext(c.part, ctx, c.seconds) for c, ctx in zip(ctxs, sent_ctxs)]

    def plan(self, names: list[str], adopt: Tensor | None = None) -> Tensor:
        if adopt is not None:
            for name, code in zip(names, adopt.tolist()):
                self.choice[name] = self.candidates[code]
            return adopt
        return torch.tensor([self.candidates.index(self.choice.get(n, self._default())) for n in names])

    def _default(self) -> str:
        return "allreduce" if "allreduce" in self.fitting else "allgather"

    def _decide(self, key: tuple[str, ...], bucket: dict[str, Any]) -> None:
        """After each candidate ran once, then every ``interval`` steps: rank 0 picks."""
        untried = [c for c in self.fitting if c not in bucket["seen"]]
        if untried and bucket["chosen"] is None:
            pick = untried[0]
        elif bucket["chosen"] is None or bucket["steps"] % self.interval == 0:
            code = torch.tensor([self.fitting.index(self._cheapest(bucket))], device=self.engine.control_device)
            pick = self.fitting[int(self.engine.broadcast(code, 0)[0])]
            bucket["chosen"] = pick
        else:
            return
        for name in key:
            self.choice[name] = pick

    def _cheapest(self, bucket: dict[str, Any]) -> str:
        latency, bandwidth = self.link["latency"], self.link["bandwidth"]
        assert latency is not None and bandwidth is not None
        n = self.engine.size
        costs = {}
        for name, (payload, seconds, dense) in bucket["seen"].items():
            wire = predict(name, n, payload, dense, latency, 1 / bandwidth)
            costs[name] = wire + seconds
        bucket["predicted"] = costs
        return min(costs, key=costs.__getitem__)

    def stats(self) -> dict[str, Any]:
        return {
            "auto": {
                ",".join(key): {"choice": b["chosen"], "predicted_seconds": b.get("predicted", {})}
                for key, b in self.buckets.items()
            }
        }

    def reset(self, name: str | None = None) -> None:
        """The members' state (owner errors); the plan stays."""
        for member in self.members.values():
            member.reset(name)
