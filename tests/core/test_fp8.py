"""The fp8 compressor (issue 42, item 3): e4m3 and e5m2 under a scale per block, against a
reference written here; exact bytes; no overflow at any magnitude; the communicators that sum
after the exchange carry it and the plain allreduce refuses it, naming why."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grace_dgc
from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import COMPRESSORS

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def reference_fp8(x: torch.Tensor, format: str, block: int) -> torch.Tensor:
    """Each block, one at a time: divided by max|x|/F (an fp32 division), cast through torch's
    float8 dtype, multiplied back."""
    dtype, out = DTYPES[format], []
    largest = float(torch.finfo(dtype).max)
    for start in range(0, x.numel(), block):
        part = x[start : start + block].float()
        peak = part.abs().max()
        scale = peak / largest if peak > 0 else torch.tensor(1.0)
        out.append((part / scale).to(dtype).float() * scale)
    return torch.cat(out)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 10_000),
    st.integers(1, 700),
    st.sampled_from(["e4m3", "e5m2"]),
    st.sampled_from([1, 32, 256]),
    st.floats(1e-20, 1e20),
)
def test_fp8_equals_the_reference_and_never_overflows(seed, n, format, block, magnitude):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * magnitude
    comp = COMPRESSORS.get("fp8")(format=format, block=block)
    payload, ctx = comp.compress(x, "w")
    assert [t.numel() * t.element_size() for t in payload] == [n, 4 * math.ceil(n / block)]
    got = comp.decompress(payload, ctx)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference_fp8(x, format, block), rtol=0, atol=0)
    # relative error per element: at most half a unit in the last place of the format, against the block's max
    relative = 2.0 ** -(4 if format == "e4m3" else 3)
    assert bool(((got - x).abs() <= x.abs() * relative + x.abs().max() * 2.0**-9).all())


@pytest.mark.parametrize("format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("repeats", [3, 3001])
def test_the_cpu_decode_gives_every_code_the_casts_bits(format, repeats):
    """On a CPU the codes are decoded through fp16 bit patterns (torch's fp8 cast is scalar there):
    every code, NaN, ±inf and ±0 included, gives the cast's very bits, in a short tensor and in
    one of several chunks (torch's fp16 cast gives NaNs other bits in its vector body than in its
    scalar tail: the NaN codes are fixed up either way)."""
    # a last, partial block whose NaN codes fall in torch's scalar tail
    codes = torch.cat(
        [
            torch.arange(256, dtype=torch.uint8).repeat(repeats),
            torch.tensor([125, 126, 127, 253, 254, 255, 128], dtype=torch.uint8),
        ]
    )
    cast = codes.view(DTYPES[format]).float()
    comp = COMPRESSORS.get("fp8")(format=format, block=256)
    scales = torch.ones(-(-codes.numel() // 256))
    got = comp.decompress_into([codes, scales], (codes.shape, torch.float32), torch.empty(codes.numel()))
    assert torch.equal(got.view(torch.int32), cast.view(torch.int32))


def test_the_communicators_that_sum_after_the_exchange_carry_it():
    for communicator in ("reduce_scatter", "allgather", "hierarchical", "broadcast"):
        grace = grace_dgc.build("fp8", "residual", communicator, engine="local")
        x = torch.randn(300, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(grace.step(x.clone(), "w"), x, rtol=0.07, atol=1e-3)
    with pytest.raises(GraceConfigError, match="cannot be summed"):
        grace_dgc.build("fp8", "none", "allreduce", engine="local")
    with pytest.raises(GraceConfigError, match="format='e3m4'"):
        COMPRESSORS.get("fp8")(format="e3m4")
