import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_dgc import wire

dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8, torch.bool]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(dtypes), st.integers(0, 9)), min_size=1, max_size=4))
def test_encode_decode_round_trip(spec):
    payload = [(torch.rand(n) * 100).to(dt) for dt, n in spec]
    buffer, header = wire.encode(payload)
    assert buffer.dtype == torch.uint8 and header.tolist() == [t.numel() * t.element_size() for t in payload]
    back = wire.decode(buffer, header, payload)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(payload, back))


def test_decode_uses_the_template_trailing_shape_with_other_lengths():
    mine = [torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32)]
    theirs = [torch.arange(12.0).reshape(4, 3), torch.arange(4, dtype=torch.int32)]
    back = wire.decode(*wire.encode(theirs), mine)
    assert back[0].shape == (4, 3) and torch.equal(back[0], theirs[0]) and torch.equal(back[1], theirs[1])


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(0, 100), st.integers(0, 2**32 - 1))
def test_pack_bits_round_trip_and_size(bits, n, seed):
    rng = np.random.default_rng(seed)
    codes = torch.from_numpy(rng.integers(0, 2**bits, n).astype(np.uint8))
    packed = wire.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == wire.packed_nbytes(n, bits) == -(-n * bits // 8)
    assert torch.equal(wire.unpack_bits(packed, bits, n), codes)


def test_pack_bits_layout_is_little_endian_within_bytes():
    # independent reference: numpy packbits with little bit order on the codes' bits
    codes = torch.tensor([1, 0, 3, 2, 1], dtype=torch.uint8)
    bits = np.array([[c >> i & 1 for i in range(2)] for c in codes.tolist()], dtype=np.uint8).reshape(-1)
    assert wire.pack_bits(codes, 2).tolist() == np.packbits(bits, bitorder="little").tolist()


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.integers(1, 300), st.integers(0, 2**32 - 1))
def test_host_and_word_packers_write_the_same_stream(bits, n, seed):
    """The CPU packs with numpy and accelerators with the torch SWAR stages: one stream, checked
    here on the CPU against a bit-by-bit reference (code i at bits [i·bits, (i+1)·bits))."""
    codes = torch.from_numpy(np.random.default_rng(seed).integers(0, 1 << bits, n, dtype=np.uint8))
    stream = np.zeros(wire.packed_nbytes(n, bits) * 8, dtype=np.uint8)
    for bit in range(bits):
        stream[np.arange(n) * bits + bit] = (codes.numpy() >> bit) & 1
    reference = np.packbits(stream, bitorder="little")
    assert np.array_equal(wire._pack_host(codes, bits).numpy(), reference)
    assert np.array_equal(wire._pack_words(codes, bits, None).numpy(), reference)
    packed = torch.from_numpy(reference)
    host = wire._unpack_host(packed, bits, n)
    words = wire._unpack_words(packed, bits, 0, n, None)
    assert torch.equal(host, codes) and torch.equal(words, codes)


def test_an_accelerator_gets_chunks_that_bound_the_temporaries():
    """On an accelerator a tensor runs in chunks of ACCELERATOR_CHUNK elements (a multiple of
    ``multiple``), so a method's scratch is a few chunks, not a few gradients; the chunks
    cover the tensor in order."""
    from grace_dgc.workspace import ACCELERATOR_CHUNK, chunks

    n = 2 * ACCELERATOR_CHUNK + 13
    spans = chunks(n, torch.device("cuda"), multiple=24)
    size = ACCELERATOR_CHUNK // 24 * 24
    assert spans[0] == (0, size) and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(stop - start == size for start, stop in spans[:-1])
    assert chunks(5, "cuda") == [(0, 5)] and chunks(0, "cuda") == []


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)
@pytest.mark.parametrize("name", ["terngrad", "natural", "twobit", "qsgd", "onebit", "signsgd"])
def test_the_kernels_chunk_by_chunk_send_what_one_chunk_sends(monkeypatch, name, device):
    """The fused kernels run once per chunk (as on a GPU, where chunks bound the scratch): many
    small chunks give the payload bytes and decoded tensor of one chunk and of the torch ops
    (here on a CPU under Triton's interpreter, chunks of 256 elements)."""
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it on Linux x86-64)")
    from method_params import PARAMS
    from test_cuda import round_trip

    from grace_dgc import kernels, workspace
    from grace_dgc.registry import COMPRESSORS

    if device == "cpu" and not kernels._interpreted():
        pytest.skip("on CPU tensors the kernels run only under Triton's interpreter (tests/conftest.py sets it)")
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3)).reshape(-1, 10).to(device)

    def sent_and_decoded():
        comp = COMPRESSORS.get(name)(**PARAMS.get(name, {}))
        payload, out = round_trip(comp, x)
        return [wire.as_bytes(t).clone() for t in payload], out

    with kernels.use("torch"):
        plain = sent_and_decoded()
    monkeypatch.setattr(kernels, "_mode", "triton")
    one_chunk = sent_and_decoded()
    monkeypatch.setattr(workspace, "PARALLEL_GRAIN", 64)
    monkeypatch.setattr(workspace, "CPU_CHUNK", 256)
    monkeypatch.setattr(workspace, "ACCELERATOR_CHUNK", 256)
    assert len(workspace.chunks(x.numel(), device, 8)) > 10
    chunked = sent_and_decoded()
    for other in (one_chunk, plain):
        assert len(chunked[0]) == len(other[0])
        assert all(torch.equal(a, b) for a, b in zip(chunked[0], other[0])), f"{name}: payload bytes differ"
        assert torch.equal(chunked[1], other[1]), f"{name}: decoded tensors differ"
