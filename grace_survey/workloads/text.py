"""A small decoder-only transformer language model on Python's own help text (``pydoc-gpt``).

The corpus
    ``pydoc_data.topics.topics``: the ~465k characters of English help text (``help("if")``...)
    shipped with every CPython, so the workload needs no files and no network. The topics are
    joined in sorted key order, with nothing between them, into one text. The text changes
    between Python releases: ``info`` records ``python_version``, the text's SHA-256
    (``text_sha256``, first 16 hex digits), its length in characters and the vocabulary size,
    so a result says which text it used. The corpus is the same for every seed.

Tokens
    Character level: the vocabulary is the sorted set of the text's characters (every code
    point, so id order is code-point order and the mapping is deterministic); token id = the
    character's index in it. Encoding is one vectorised look-up (``numpy.searchsorted`` on the
    code points), no Python loop over the text.

Splits
    Contiguous by characters: the first 90% is train, the next 5% valid, the last 5% test
    (``valid`` is what the survey's lr tuning scores on). Each split is cut on its own into
    non-overlapping windows of ``context`` + 1 characters sharing one character with the next
    window: ``inputs[i] = s[i·T : i·T + T]`` and ``targets[i] = s[i·T + 1 : i·T + T + 1]``
    (T = ``context``), int64 ``(N, T)``; no window crosses a split boundary. ``train_chars``
    keeps a prefix of the train text (quick runs and tests).

The model (GPT-2 structure, written out; no dropout)
    h⁰ = E[x_t] + P[t]                                   token and learned position embeddings
    for each of the ``n_layer`` blocks (pre-LayerNorm):
        h ← h + W_o · Attn(LN₁(h))                       causal multi-head self-attention,
                                                        ``n_head`` heads of d_model / n_head,
                                                        softmax(q kᵀ / √d_head + causal mask) v
                                                        via ``F.scaled_dot_product_attention``
        h ← h + W₂ · GELU(W₁ · LN₂(h))                   MLP of width 4·d_model
    logits = W_head · LN_f(h)                            (N, T, vocab)

    Every linear map has a bias except the head; LayerNorms have a gain and a bias. The head is
    *not* tied to the token embedding: with a character vocabulary (~100 symbols) tying would
    save ~0.8% of the parameters, and an untied head keeps every gradient tensor the gradient
    of one parameter, as the compressors see them. Parameters (d = d_model, V = vocab, L =
    n_layer, T = context):  V·d + T·d + L·(12·d² + 13·d) + 2·d + d·V.
    Initialisation as GPT-2: every weight N(0, 0.02²), the two residual projections (W_o, W₂)
    N(0, (0.02 / √(2L))²), biases 0, LayerNorm gains 1; drawn from the global torch RNG only,
    so ``torch.manual_seed(seed); make_model()`` is the same model on every rank.

Defaults and why
    d_model=256, n_layer=4, n_head=4, context=64: 3,228,672 parameters (at V = 103, Python
    3.11.7), the "few million" where compressing a gradient is worth its cost. Measured on this
    project's 2-core CPU with the survey's 2 ranks (one torch thread each): a step of 16
    windows per rank (1,024 tokens) is ~225 ms of forward+backward and ~250 ms in all with a
    dense allreduce of its 12.9 MB gradient, so one epoch over the whole train split (204
    steps of the global batch of 32 windows) takes ~50 s. d_model=128 (0.83M parameters) is
    ~3× cheaper per step but learns less per epoch; larger batches learned less per epoch too.
    SGD with momentum 0.9 at lr 0.15 and the gradient's global norm clipped to 1.0, no weight
    decay (lr 0.3 and 0.1-0.3 at twice the batch were slower): dense next-token test accuracy
    (global batch 32) reaches 0.43 / 0.51 / 0.57 / 0.61 / 0.62 / 0.64 after epochs 1-6 (test
    loss 1.31 nats, perplexity 3.7); hence 6 epochs and ``target_accuracy`` 0.55, reached at
    about half of them. For scale: always predicting a space, the most common character, scores
    0.25 on the test split (the last topics, ``typesseq`` to ``yield``, hold indented tables
    and code) and 0.18 on train. Perplexity is exp(test loss), per character.
"""

from __future__ import annotations

import functools
import hashlib
import math
import platform
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grace_dgc.errors import GraceConfigError, check_range
from grace_survey.workloads.contract import Workload

Split = tuple[Tensor, Tensor]

SPLIT_FRACTIONS = (0.90, 0.05, 0.05)  # train, valid, test: contiguous, in this order


# --------------------------------------------------------------------------------- the corpus
def corpus_text() -> str:
    """Python's help topics (``pydoc_data.topics.topics``) joined in sorted key order."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


def text_sha256(text: str) -> str:
    """SHA-256 of the text's UTF-8 bytes (hex)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def vocabulary(text: str) -> str:
    """The sorted set of the text's characters: token id i is character ``vocabulary[i]``."""
    return "".join(sorted(set(text)))


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


def encode(text: str, vocab: str) -> Tensor:
    """Token ids (int64) of ``text``; every character must be in ``vocab`` (sorted)."""
    keys = _code_points(vocab)
    codes = _code_points(text)
    ids = np.searchsorted(keys, codes)
    ids_in = np.minimum(ids, len(keys) - 1)
    if len(codes) and not np.array_equal(keys[ids_in], codes):
        bad = text[int(np.flatnonzero(keys[ids_in] != codes)[0])]
        raise GraceConfigError(f"character {bad!r} is not in the vocabulary")
    return torch.from_numpy(ids.astype(np.int64))


def decode(ids: Tensor, vocab: str) -> str:
    """The text of token ids ``ids`` (any shape, read in row-major order)."""
    return "".join(vocab[i] for i in ids.reshape(-1).tolist())


def windows(tokens: Tensor, context: int) -> Split:
    """Non-overlapping ``(inputs, targets)`` windows of ``context`` tokens: targets are the
    inputs shifted by one token (the last target of window i is the first input of i + 1)."""
    count = (len(tokens) - 1) // context
    stream = tokens[: count * context + 1]
    return stream[:-1].view(count, context), stream[1:].view(count, context)


def split_bounds(length: int) -> tuple[int, int]:
    """Character offsets ``(train_end, valid_end)``: [0, train_end) is train, [train_end,
    valid_end) valid, [valid_end, length) test."""
    train_end = int(length * SPLIT_FRACTIONS[0])
    valid_end = int(length * (SPLIT_FRACTIONS[0] + SPLIT_FRACTIONS[1]))
    return train_end, valid_end


# ---------------------------------------------------------------------------------- the model
class Block(nn.Module):
    """One pre-LayerNorm transformer block: causal self-attention, then a 4× GELU MLP, each
    added to the residual stream."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_proj = nn.Linear(4 * d_model, d_model)

    def attention(self, x: Tensor) -> Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # (N, T, d) -> (N, heads, T, d_head)
        q, k, v = (z.view(n, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(n, t, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """GPT-style decoder-only transformer: token ids ``(N, T)`` (T ≤ ``context``) → logits
    ``(N, T, vocab_size)``; the output at position t depends on tokens 0..t only."""

    def __init__(self, vocab_size: int, context: int, d_model: int, n_layer: int, n_head: int) -> None:
        super().__init__()
        if d_model % n_head:
            raise GraceConfigError(f"d_model={d_model} must be divisible by n_head={n_head}")
        self.context = context
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif ".ln" in name or name.startswith("ln_"):
                nn.init.ones_(param)
            elif name.endswith("proj.weight"):  # the residual projections (proj, fc_proj)
                nn.init.normal_(param, 0.0, 0.02 / math.sqrt(2 * n_layer))
            else:
                nn.init.normal_(param, 0.0, 0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"a window of {t} tokens exceeds the model's context of {self.context}")
        positions = torch.arange(t, device=tokens.device)
        h = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def transformer_parameter_count(vocab_size: int, context: int, d_model: int, n_layer: int) -> int:
    """Parameters of :class:`CharTransformer` by formula, without building it."""
    d = d_model
    per_block = 12 * d * d + 13 * d  # LN 2d, qkv 3d²+3d, proj d²+d, LN 2d, fc 4d²+4d, fc_proj 4d²+d
    return vocab_size * d + context * d + n_layer * per_block + 2 * d + d * vocab_size


# ------------------------------------------------------------------------------- the workload
DEFAULTS: dict[str, Any] = dict(context=64, d_model=256, n_layer=4, n_head=4)


def build_workload(
    data_dir: str | None,
    seed: int,
    context: int = DEFAULTS["context"],
    d_model: int = DEFAULTS["d_model"],
    n_layer: int = DEFAULTS["n_layer"],
    n_head: int = DEFAULTS["n_head"],
    train_chars: int | None = None,
) -> Workload:
    """The ``pydoc-gpt`` workload: a character-level GPT on Python's help text (see the module
    docstring). ``data_dir`` and ``seed`` are unused: the corpus ships with Python and is the
    same for every seed. ``train_chars`` keeps the first N characters of the train split."""
    context, d_model, n_layer, n_head = _checked_shape(context, d_model, n_layer, n_head)
    text = corpus_text()
    vocab = vocabulary(text)
    train_tokens, valid_tokens, test_tokens = _split_tokens(encode(text, vocab), context, train_chars)
    vocab_size = len(vocab)
    make_model = functools.partial(CharTransformer, vocab_size, context, d_model, n_layer, n_head)
    info = _facts(text, vocab, (train_tokens, valid_tokens, test_tokens), context, d_model, n_layer, n_head)
    digest = info["text_sha256"]
    return Workload(
        name="pydoc-gpt",
        train=windows(train_tokens, context),
        valid=windows(valid_tokens, context),
        test=windows(test_tokens, context),
        make_model=make_model,
        loss="lm",
        description=f"Python {info['python_version']} help text (pydoc_data topics, {len(text):,} characters, "
        f"sha256 {digest}, {vocab_size}-character vocabulary, 90/5/5 contiguous split, windows of {context}); "
        f"GPT-style decoder ({n_layer} pre-LN blocks, d_model {d_model}, {n_head} heads, untied head)",
        # trained the way nanoGPT trains its character-level GPT (shakespeare_char): AdamW,
        # lr 1e-3 warmed up over 100 steps then cosine-decayed to 1e-4, betas (0.9, 0.99),
        # weight decay 0.1, global-norm clip 1.0
        batch_size=16,
        optimizer="adamw",
        lr=1e-3,
        betas=(0.9, 0.99),
        weight_decay=0.1,
        lr_schedule="cosine",
        warmup_steps=100,
        epochs=6,
        target_accuracy=0.55,
        grad_clip=1.0,
        info=info,
    )


def _checked_shape(context: int, d_model: int, n_layer: int, n_head: int) -> tuple[int, int, int, int]:
    """The model's sizes, each checked (and ``d_model`` divisible by ``n_head``)."""
    context = check_range("context", context, 1, None, kind=int)
    d_model = check_range("d_model", d_model, 1, None, kind=int)
    n_layer = check_range("n_layer", n_layer, 1, None, kind=int)
    n_head = check_range("n_head", n_head, 1, None, kind=int)
    if d_model % n_head:
        raise GraceConfigError(
            f"d_model={d_model} must be divisible by n_head={n_head} (each head gets d_model / n_head "
            f"dimensions); accepted: n_head among the divisors of d_model"
        )
    return context, d_model, n_layer, n_head


def _split_tokens(tokens: Tensor, context: int, train_chars: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """The corpus's train, valid and test tokens (:data:`SPLIT_FRACTIONS`, the train split cut
    to ``train_chars``); every split holds at least one window of ``context`` tokens."""
    train_end, valid_end = split_bounds(len(tokens))
    if train_chars is not None:
        train_chars = check_range("train_chars", train_chars, context + 1, train_end, kind=int)
    train_tokens = tokens[: train_chars if train_chars is not None else train_end]
    valid_tokens, test_tokens = tokens[train_end:valid_end], tokens[valid_end:]
    shortest = min(len(valid_tokens), len(test_tokens))
    if shortest < context + 1:
        raise GraceConfigError(
            f"context={context} is out of range: the valid/test splits have {shortest} characters; "
            f"accepted: [1, {shortest - 1}]"
        )
    return train_tokens, valid_tokens, test_tokens


def _facts(
    text: str,
    vocab: str,
    splits: tuple[Tensor, Tensor, Tensor],
    context: int,
    d_model: int,
    n_layer: int,
    n_head: int,
) -> dict[str, Any]:
    """The workload's ``info``: the corpus, its tokenization and splits, the model's shape."""
    train_tokens, valid_tokens, test_tokens = splits
    train_end, valid_end = split_bounds(len(text))
    return {
        "source": "pydoc_data.topics.topics (Python's help text, shipped with the interpreter)",
        "python_version": platform.python_version(),
        "text_sha256": text_sha256(text)[:16],
        "text_chars": len(text),
        "vocab_size": len(vocab),
        "vocabulary": vocab,
        "tokenization": "character (vocabulary = the sorted set of the text's characters)",
        "split_chars": {
            "train": len(train_tokens),
            "valid": len(valid_tokens),
            "test": len(test_tokens),
        },
        "split_offsets": {
            "train": [0, len(train_tokens)],
            "valid": [train_end, valid_end],
            "test": [valid_end, len(text)],
        },
        "context": context,
        "bptt": context,
        "model": {"d_model": d_model, "n_layer": n_layer, "n_head": n_head, "tied_embeddings": False},
    }
