"""The ``pydoc-gpt`` workload (grace_survey.workloads.text): corpus facts, windows, splits, the
transformer's shape, causality and size, option checks, and that a short SGD run learns."""

import hashlib
import math
import platform

import pytest
import torch
import torch.nn.functional as F

from grace_dgc.errors import GraceConfigError
from grace_survey.workloads import text as text_mod
from grace_survey.workloads.text import CharTransformer, build_workload, corpus_text, decode

SMALL = dict(context=16, d_model=32, n_layer=2, n_head=4)


@pytest.fixture(scope="module")
def corpus():
    return corpus_text()


@pytest.fixture(scope="module")
def workload():
    return build_workload(None, 0, **SMALL)


def test_corpus_facts_recorded_and_stable(corpus, workload):
    from pydoc_data.topics import topics

    assert corpus == "".join(topics[k] for k in sorted(topics))
    assert len(corpus) > 100_000
    info = workload.info
    assert info["python_version"] == platform.python_version()
    assert info["text_sha256"] == hashlib.sha256(corpus.encode("utf-8")).hexdigest()[:16]
    assert info["text_chars"] == len(corpus)
    assert info["vocab_size"] == len(set(corpus)) == len(info["vocabulary"])
    assert info["vocabulary"] == "".join(sorted(set(corpus)))
    assert info["text_sha256"] in workload.description
    # the same corpus and tensors for another build and another seed
    again = build_workload(None, 7, **SMALL)
    assert {k: again.info[k] for k in ("text_sha256", "text_chars", "vocab_size")} == {
        k: info[k] for k in ("text_sha256", "text_chars", "vocab_size")
    }
    for split in ("train", "valid", "test"):
        for a, b in zip(getattr(workload, split), getattr(again, split)):
            assert torch.equal(a, b)


def test_encode_decode_round_trip(corpus, workload):
    vocab = workload.info["vocabulary"]
    piece = corpus[1000:3000]
    ids = text_mod.encode(piece, vocab)
    assert ids.dtype == torch.int64 and ids.shape == (len(piece),)
    assert ids.min() >= 0 and ids.max() < len(vocab)
    assert decode(ids, vocab) == piece
    with pytest.raises(GraceConfigError, match="not in the vocabulary"):
        text_mod.encode("abc\u2603", vocab)  # a snowman is not in Python's help text


def test_windows_shift_by_one_and_rebuild_the_text(corpus, workload):
    context, vocab = SMALL["context"], workload.info["vocabulary"]
    offsets = workload.info["split_offsets"]
    for split in ("train", "valid", "test"):
        inputs, targets = getattr(workload, split)
        start, end = offsets[split]
        assert inputs.dtype == targets.dtype == torch.int64
        assert inputs.shape == targets.shape == ((end - start - 1) // context, context)
        assert torch.equal(targets[:, :-1], inputs[:, 1:])
        assert torch.equal(targets[:-1, -1], inputs[1:, 0])  # windows do not overlap and leave no gap
        # exact text: window k is characters [start + k·T, start + (k+1)·T) of the corpus
        k = len(inputs) // 2
        assert decode(inputs[k : k + 3], vocab) == corpus[start + k * context : start + (k + 3) * context]
        assert decode(targets[k], vocab) == corpus[start + k * context + 1 : start + (k + 1) * context + 1]
        assert decode(targets[-1, -1:], vocab) == corpus[start + len(inputs) * context]


def test_splits_contiguous_and_disjoint(corpus, workload):
    info = workload.info
    offsets = info["split_offsets"]
    assert offsets["train"][0] == 0
    assert offsets["train"][1] == offsets["valid"][0] == int(0.9 * len(corpus))
    assert offsets["valid"][1] == offsets["test"][0] == int(0.95 * len(corpus))
    assert offsets["test"][1] == len(corpus)
    assert sum(info["split_chars"].values()) == len(corpus)
    # each split's windows hold only characters of its own range
    context = SMALL["context"]
    for split in ("train", "valid", "test"):
        start, end = offsets[split]
        last = start + len(getattr(workload, split)[1]) * context  # the last target character
        assert last < end
    # train_chars keeps a prefix of train; valid and test do not move
    short = build_workload(None, 0, train_chars=1000, **SMALL)
    assert short.info["split_chars"]["train"] == 1000
    assert torch.equal(short.train[0], workload.train[0][: len(short.train[0])])
    assert len(short.train[0]) == (1000 - 1) // context
    assert torch.equal(short.test[0], workload.test[0]) and torch.equal(short.valid[1], workload.valid[1])


def test_output_shape_and_causality(workload):
    torch.manual_seed(0)
    model = workload.make_model().eval()
    vocab, context = workload.info["vocab_size"], SMALL["context"]
    x = workload.test[0][:3]
    with torch.no_grad():
        out = model(x)
        assert out.shape == (3, context, vocab) and out.dtype == torch.float32
        assert model(x[:, :5]).shape == (3, 5, vocab)  # shorter windows work too
        for t in (0, 7, context - 1):
            changed = x.clone()
            changed[:, t] = (changed[:, t] + 1) % vocab
            other = model(changed)
            assert torch.equal(other[:, :t], out[:, :t])  # exactly: nothing before t sees token t
            assert not torch.allclose(other[:, t], out[:, t])  # and position t does
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, context + 1, dtype=torch.int64))


def test_same_seed_same_model():
    a = build_workload(None, 0, **SMALL)
    torch.manual_seed(3)
    first = a.make_model()
    torch.manual_seed(3)
    second = a.make_model()
    for p, q in zip(first.parameters(), second.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "vocab, context, d, layers, heads", [(103, 64, 256, 4, 4), (50, 16, 32, 2, 4), (7, 3, 12, 1, 3)]
)
def test_parameter_count_by_hand(vocab, context, d, layers, heads):
    embeddings = vocab * d + context * d
    attention = (d * 3 * d + 3 * d) + (d * d + d)  # qkv and output projection, with biases
    mlp = (d * 4 * d + 4 * d) + (4 * d * d + d)
    layer_norms = 2 * (2 * d)
    per_block = attention + mlp + layer_norms
    head = d * vocab  # untied, no bias
    expected = embeddings + layers * per_block + 2 * d + head
    model = CharTransformer(vocab, context, d, layers, heads)
    assert sum(p.numel() for p in model.parameters()) == expected
    assert text_mod.transformer_parameter_count(vocab, context, d, layers) == expected


def test_default_size_is_a_few_million():
    from grace_survey.workloads.registry import get_workload

    workload = get_workload("pydoc-gpt", train_chars=5000)
    defaults = text_mod.DEFAULTS
    assert workload.loss == "lm"
    assert workload.parameters == text_mod.transformer_parameter_count(
        workload.info["vocab_size"], defaults["context"], defaults["d_model"], defaults["n_layer"]
    )
    assert 1_000_000 < workload.parameters < 10_000_000
    assert workload.info["parameters"] == workload.parameters


@pytest.mark.parametrize(
    "options, option",
    [
        (dict(d_model=30, n_head=4), "d_model"),
        (dict(d_model=0), "d_model"),
        (dict(n_head=0), "n_head"),
        (dict(n_layer=0), "n_layer"),
        (dict(n_layer=1.5), "n_layer"),
        (dict(context=0), "context"),
        (dict(context=100_000), "context"),
        (dict(train_chars=5), "train_chars"),
        (dict(train_chars=10**9), "train_chars"),
        (dict(train_chars="all"), "train_chars"),
    ],
)
def test_bad_options_name_the_option(options, option):
    with pytest.raises(GraceConfigError, match=option):
        build_workload(None, 0, **{**SMALL, **options})


def test_short_sgd_run_beats_the_unigram_baseline():
    workload = build_workload(None, 0, context=32, d_model=64, n_layer=1, n_head=4, train_chars=40_000)
    inputs, targets = workload.train
    vocab = workload.info["vocab_size"]
    counts = torch.bincount(targets.reshape(-1), minlength=vocab).double()
    probs = counts[counts > 0] / counts.sum()
    unigram = float(-(probs * probs.log()).sum())  # nats: the best loss without context

    def valid_loss(model):
        with torch.no_grad():
            out = model(workload.valid[0])
            return F.cross_entropy(out.reshape(-1, vocab), workload.valid[1].reshape(-1)).item()

    torch.manual_seed(0)
    model = workload.make_model()
    start = valid_loss(model)
    assert start > math.log(vocab) - 0.5  # starts near uniform, above the unigram entropy
    # a small model takes a larger step than the default's 0.15 (measured: 2.92 nats after 120 steps)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=workload.momentum)
    generator = torch.Generator().manual_seed(0)
    for _ in range(120):
        idx = torch.randint(len(inputs), (32,), generator=generator)
        optimizer.zero_grad()
        out = model(inputs[idx])
        F.cross_entropy(out.reshape(-1, vocab), targets[idx].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), workload.grad_clip or math.inf)
        optimizer.step()
    assert valid_loss(model) < unigram - 0.15 < start


def test_the_transformer_survey_config_loads():
    import os

    from grace_survey.config import settings as cfg

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs", "transformer.toml")
    conf = cfg.load_config(path)
    assert conf.workload == "pydoc-gpt"
    assert [m["compressor"] for m in conf.methods] == ["none", "efsignsgd", "efsignsgd", "efsignsgd", "topk", "dgc"]
    schedules = [m.get("schedule", {}).get("name") for m in conf.methods]
    assert schedules == [None, "onebit_adam", "onebit_adam", "zero_one_adam", None, None]
    assert conf.methods[-1]["params"]["momentum"] == 0.0  # DGC's memory under AdamW: no momentum of its own
