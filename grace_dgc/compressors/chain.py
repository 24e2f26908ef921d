"""Chained compressors: a selection, then a quantizer on what it kept (``"topk>qsgd"``).

Not a registered class: a chain is named by its two stages joined by ``>`` and built by the
compressor registry (``build("topk>qsgd", "residual", "allgather", compress_ratio=0.01,
quantum_num=3)``); each keyword goes to the stage whose constructor takes it (to both where
both do, e.g. ``seed``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from ..errors import GraceConfigError
from ..interfaces import Compressor, Payload
from ..registry import COMPRESSORS
from .packed import PackedCompressor

SEPARATOR = ">"


class Chain(Compressor):
    """C = Q ∘ S: a selection S keeps k entries of the tensor, a quantizer Q compresses the
    k values it kept (SparseLoCo's top-k values in 2 bits, Streaming DiLoCo-style low-bit
    values of a sparse update):

        S(x) = (v, I)  with v = x_I, |I| = k         (topk: the k largest magnitudes)
        C(x) = (Q(v), I),   D(C(x)) = scatter_I(D_Q(Q(v)))

    Wire: Q's payload of the k values, then S's int32 indices (or Q's payload of the whole
    tensor where S sends it whole): every byte counted as it travels. Error feedback acts on
    the whole composition: a residual keeps x − D(C(x)), the selection's and the
    quantization's error together (``subtract_sent_`` subtracts the dequantized values at
    the kept indices). Unbiased only where both stages are; the chain is biased whenever S
    is (top-k). Aggregation: the average over ranks of the decompressed payloads (the
    quantized values of different selections cannot be summed: allgather or broadcast).

    Stages accepted: S a sparse selection of a fixed count (``topk``: every rank keeps the
    same k, so Q's ctx is the same on every rank), Q a quantizer of packed codes that
    averages (``qsgd``, ``twobit``, ``terngrad``, ``natural``, ``efsignsgd``, ``onebit``).
    Anything else is refused by name, with why.
    """

    summable = False
    chunkable = False
    sparse = False
    rounds = 1
    prerounds = False
    registered_name: ClassVar[str] = "chain"  # each instance names itself, e.g. "topk>qsgd"

    def __init__(self, selection: Compressor, quantizer: Compressor, name: str) -> None:
        self.selection, self.quantizer = selection, quantizer
        self.__dict__["registered_name"] = name  # the instance's own name (handshake, checkpoint)
        self.biased = selection.biased or quantizer.biased
        self.may_overflow = selection.may_overflow or quantizer.may_overflow

    SETTINGS = ("stages",)
    STATE = ("selection", "quantizer")  # each stage's own state (qsgd's stream position, …) nests

    @property
    def stages(self) -> dict[str, dict[str, Any]]:
        """Both stages' names and settings (what the ranks compare and a checkpoint records)."""
        return {part.registered_name: part.agreed_settings() for part in (self.selection, self.quantizer)}

    def bind(self, engine: Any) -> None:
        self.selection.bind(engine)
        self.quantizer.bind(engine)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        kept, selected = self.selection.compress(tensor, name)
        values, rest = kept[0], kept[1:]
        codes, coded = self.quantizer.compress(values.reshape(-1), f"{name}{SEPARATOR}values")
        return [*codes, *rest], (selected, coded, len(codes))

    def _kept(self, payload: Payload, ctx: Any) -> Payload:
        """The selection's payload again: the dequantized values and the indices."""
        selected, coded, width = ctx
        values = self.quantizer.decompress(payload[:width], coded)
        return [values, *payload[width:]]

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        return self.selection.decompress(self._kept(payload, ctx), ctx[0])

    def decompress_into(self, payload: Payload, ctx: Any, out: Tensor) -> Tensor:
        return self.selection.decompress_into(self._kept(payload, ctx), ctx[0], out)

    def subtract_sent_(self, tensor: Tensor, payload: Payload, ctx: Any) -> Tensor:
        return self.selection.subtract_sent_(tensor, self._kept(payload, ctx), ctx[0])

    def sent_mask(self, payload: Payload, ctx: Any) -> Tensor:
        return self.selection.sent_mask(self._kept(payload, ctx), ctx[0])

    def mask_sent_(self, tensor: Tensor, payload: Payload, ctx: Any) -> Tensor:
        return self.selection.mask_sent_(tensor, self._kept(payload, ctx), ctx[0])


def refusal(selection: Any, quantizer: Any) -> str | None:
    """Why ``selection>quantizer`` is not a chain grace_dgc can build, or None."""
    first, second = selection.registered_name, quantizer.registered_name
    if not (selection.sparse and getattr(selection, "fixed_count", False)):
        return (
            f"{first!r} is not a selection of a fixed count (the first stage keeps the same k entries on every "
            "rank, so that the quantized values decode alike: topk, chunk_topk)"
        )
    if not issubclass(quantizer, PackedCompressor) or quantizer.sparse or not quantizer.average:
        return (
            f"{second!r} is not a quantizer of packed codes that averages (accepted second stages: qsgd, statq, fp4, "
            "twobit, terngrad, natural, efsignsgd, onebit)"
        )
    if quantizer.rounds > 1 or quantizer.prerounds:
        return f"{second!r} exchanges with the other ranks while it compresses; a chain's stages compress alone"
    return None


class ChainFactory:
    """What the compressor registry hands out for a chain's name: callable like a class with
    the stages' keyword parameters, with a class's attributes for those who ask before
    building one (a configuration check asks ``summable``)."""

    summable = False
    rounds = 1
    sparse = False
    chunkable = False

    def __init__(self, name: str, selection: Any, quantizer: Any, accepted: dict[str, list[str]]) -> None:
        self.registered_name, self.selection, self.quantizer, self.accepted = name, selection, quantizer, accepted

    def params(self) -> list[str]:
        """The keyword parameters either stage accepts, in order."""
        names = self.accepted[self.selection.registered_name] + self.accepted[self.quantizer.registered_name]
        return list(dict.fromkeys(names))

    def __call__(self, **params: Any) -> Chain:
        unknown = sorted(set(params) - set(self.params()))
        if unknown:
            raise GraceConfigError(
                f"compressor {self.registered_name!r}: unknown parameter {', '.join(map(repr, unknown))}; "
                f"accepted: {', '.join(self.params()) or '(none)'}"
            )
        stages = []
        for cls in (self.selection, self.quantizer):
            mine = self.accepted[cls.registered_name]
            stages.append(cls(**{key: value for key, value in params.items() if key in mine}))
        return Chain(stages[0], stages[1], self.registered_name)


def compose(classes: list[Any]) -> ChainFactory:
    """The registry's hook for a name with ``>``: the factory of that chain, or a
    :class:`GraceConfigError` saying why those stages cannot be chained."""
    names = [cls.registered_name for cls in classes]
    name = SEPARATOR.join(names)
    if len(classes) != 2:
        raise GraceConfigError(f"compressor {name!r}: a chain has two stages, a selection and a quantizer (topk>qsgd)")
    reason = refusal(classes[0], classes[1])
    if reason:
        raise GraceConfigError(f"compressor {name!r} cannot be chained: {reason}")
    accepted = {n: COMPRESSORS.accepted_params(n) for n in names}
    return ChainFactory(name, classes[0], classes[1], accepted)


COMPRESSORS.compose = compose
