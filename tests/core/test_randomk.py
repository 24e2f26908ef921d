"""random-k's indices (grace_dgc.compressors.randomk): the first k outputs of a keyed Feistel
permutation, computed on the gradient's device. Checked against a plain-Python reference written
here (one integer at a time), the Triton kernel bit for bit against the torch ops (under Triton's
interpreter here, compiled on a GPU), and the statistics a uniform k-subset must have."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import grace_dgc
from grace_dgc import kernels
from grace_dgc.compressors import randomk

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run `make gpu-check` on a machine with one")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def reference_keys(seed, name, step):
    """splitmix64 from (seed, crc32(name), step), as the module's docstring states it."""
    import zlib

    m64 = 2**64 - 1
    state = (seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode()) * 0xBF58476D1CE4E5B9 + step) & m64
    keys = []
    for _ in range(6):
        state = (state + 0x9E3779B97F4A7C15) & m64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & m64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
        keys.append((z ^ (z >> 31)) & 0x7FFFFFFF)
    return keys


def reference_indices(n, k, keys):
    """π(0…k−1) walked into range(n), one Python integer at a time."""

    def hash32(v, key):
        h = v ^ key
        h ^= h >> 16
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x5BD1E995) & 0xFFFFFFFF
        return h ^ (h >> 16)

    bits = max(1, (n - 1).bit_length())

    def pi(x):
        a, b = bits // 2, bits - bits // 2
        for key in keys:
            high, low = x >> b, x & ((1 << b) - 1)
            x = (low << a) | (high ^ (hash32(low, key) & ((1 << a) - 1)))
            a, b = b, a
        return x

    out = []
    for i in range(k):
        x = pi(i)
        while x >= n:
            x = pi(x)
        out.append(x)
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.floats(0.0001, 1.0), st.integers(0, 2**31), st.integers(0, 50), st.text(max_size=5))
def test_indices_equal_the_plain_reference_and_are_k_distinct(n, ratio, seed, step, name):
    k = max(1, int(n * ratio))
    keys = randomk.round_keys(seed, name, step)
    assert keys == reference_keys(seed, name, step)
    got = randomk.draw_indices(seed, ratio, name, n, step)
    assert got.dtype == torch.int64 and got.tolist() == reference_indices(n, k, keys)
    assert got.unique().numel() == k and int(got.min()) >= 0 and int(got.max()) < n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 2, 3, 64, 65, 1000, 4097, 20_011, (1 << 24) + 1])
def test_the_kernel_equals_the_torch_ops_bit_for_bit(n, device):
    if device == "cpu" and not kernels._interpreted():
        pytest.skip("the kernel runs on CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, set by "
                    "tests/conftest.py where torch sees no GPU); here the cuda cases run it compiled")  # fmt: skip
    if n > 1 << 20 and device == "cpu":
        pytest.skip("a size for the compiled kernel: Triton's interpreter takes minutes on it")
    for step in range(3):
        keys = randomk.round_keys(11, "layer.weight", step)
        k = max(1, n // 7)
        with kernels.use("torch"):
            expected = randomk.keyed_indices(n, k, keys, device)
        with kernels.use("triton"):
            got = randomk.keyed_indices(n, k, keys, device)
        assert got.device.type == device and torch.equal(got.cpu(), expected.cpu())
        assert got.unique().numel() == k


@needs_cuda
def test_a_gpu_draws_what_the_cpu_draws():
    comp_cpu, comp_gpu = (grace_dgc.build("randomk", compress_ratio=0.01, seed=3).compressor for _ in range(2))
    for _ in range(3):
        x = torch.randn(3_000_001)
        (values_cpu,), (idx_cpu, _) = comp_cpu.compress(x, "w")
        (values_gpu,), (idx_gpu, _) = comp_gpu.compress(x.cuda(), "w")
        assert idx_gpu.is_cuda and torch.equal(idx_gpu.cpu(), idx_cpu) and torch.equal(values_gpu.cpu(), values_cpu)


@pytest.mark.parametrize("n, k", [(50, 3), (50, 12), (40, 20), (1000, 10)])
def test_indices_are_uniform(n, k):
    """Each index is kept with probability k/n (chi-square over 1500 steps), and kept pairs are
    neither drawn to nor kept from their neighbours."""
    counts, adjacent, draws = np.zeros(n), 0, 1500
    for step in range(draws):
        chosen = randomk.keyed_indices(n, k, randomk.round_keys(0, "w", step)).numpy()
        counts[chosen] += 1
        adjacent += np.isin(chosen + 1, chosen).sum()
    assert stats.chisquare(counts).pvalue > 1e-3
    expected_adjacent = draws * (n - 1) * k * (k - 1) / (n * (n - 1))
    assert abs(adjacent - expected_adjacent) < 5 * np.sqrt(expected_adjacent) + 1


def test_names_seeds_and_steps_each_draw_afresh():
    base = randomk.draw_indices(0, 0.1, "w", 1000, 0)
    for other in (
        randomk.draw_indices(1, 0.1, "w", 1000, 0),
        randomk.draw_indices(0, 0.1, "b", 1000, 0),
        randomk.draw_indices(0, 0.1, "w", 1000, 1),
    ):
        overlap = np.intersect1d(base.numpy(), other.numpy()).size
        assert overlap < 40  # 100 of 1000 each: ~10 in common by chance


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="need 0 <= k <= n"):
        randomk.keyed_indices(10, 11, randomk.round_keys(0, "w", 0))
