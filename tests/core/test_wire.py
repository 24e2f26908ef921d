import numpy as np
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


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.data())
def test_lookup_bytes_writes_each_codes_value_and_refuses_what_it_cannot_take(bits, data):
    """wire.lookup_bytes (a 256-row table of each byte's values) against the codes unpacked one by
    one and looked up: every width, any count (a partial last byte), any fp32 values (NaN, −0)."""
    codes = data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=1, max_size=700))
    values = torch.tensor(
        data.draw(st.lists(st.floats(width=32), min_size=2**bits, max_size=2**bits)), dtype=torch.float32
    )
    packed = wire.pack_bits(torch.tensor(codes, dtype=torch.uint8), bits)
    out = torch.full((len(codes),), 7.0)
    assert wire.lookup_bytes(packed, bits, values, out)
    expected = torch.stack([values[c] for c in codes])
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))  # bit for bit
    assert not wire.lookup_bytes(packed, bits, values, torch.empty(len(codes), dtype=torch.float64))
