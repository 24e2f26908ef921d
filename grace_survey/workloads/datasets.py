"""Dataset loaders for the survey workloads: offline generators and local-file parsers.

Nothing here downloads anything. Generated data (MNIST-1D, the fc-heavy teacher task, the
digits split) is a function of a seed only; file data is read from a directory the user
names, in the original distribution formats:

* MNIST: IDX files (``train-images-idx3-ubyte`` ...; ``.gz`` accepted), parsed with numpy.
* CIFAR-10: the python pickle batches (``cifar-10-batches-py/data_batch_1..5``, ``test_batch``).
* PTB: plain text, one sentence per line, words separated by spaces (``ptb.train.txt`` ...).

Every loader returns CPU tensors: float32 inputs already normalised for the model and int64
targets. Missing files raise :class:`MissingDataError` naming every expected file.
"""

import gzip
import os
import pickle
import random
from collections.abc import Sequence
from typing import Any, NoReturn, cast

import numpy as np
import torch
from torch import Tensor

from grace_dgc.errors import GraceDataError

Splits = tuple[Tensor, Tensor, Tensor, Tensor]  # (x, y, x_test, y_test)


class MissingDataError(FileNotFoundError):
    """A workload's files are not in the data directory (they are never downloaded)."""


def _missing(
    workload: str,
    data_dir: str | None,
    expected: Sequence[str],
    looked_in: Sequence[str],
    lacking: tuple[str, Sequence[str]] | None = None,
    gz_ok: bool = False,
) -> NoReturn:
    """Raise :class:`MissingDataError`: the files expected, where they were looked for, which
    the closest folder lacks (``lacking = (folder, names)``) and how to provide them."""
    gz = " (.gz accepted)" if gz_ok else ""
    start = f"workload {workload!r} reads local files and never downloads them; expected {', '.join(expected)}{gz}"
    if data_dir is None:
        raise MissingDataError(
            f"{start} (no --data-dir given); pass --data-dir DIR (data_dir in a config) naming the directory "
            f"that holds them"
        )
    partly = f"{lacking[0]} lacks {', '.join(lacking[1])}; " if lacking else ""
    raise MissingDataError(
        f"{start} under --data-dir {data_dir}; {partly}looked in {', '.join(looked_in)}; copy the files into "
        f"one of these or pass --data-dir naming the directory that holds them"
    )


def _find(
    data_dir: str | None, names: Sequence[str], subdirs: Sequence[str], workload: str, gz_ok: bool = True
) -> list[str]:
    """Path of each of ``names`` (plain, or ``.gz`` if ``gz_ok``) in the first of ``subdirs``
    holding all; else :class:`MissingDataError` naming what the closest folder lacks."""
    looked: list[str] = []
    closest: tuple[int, str | None, tuple[str, ...]] = (0, None, ())
    if data_dir is not None:
        for sub in subdirs:
            folder = os.path.join(data_dir, sub) if sub else data_dir
            looked.append(folder)
            found: list[str | None] = []
            for name in names:
                hits = [
                    os.path.join(folder, n) for n in (name, name + ".gz") if os.path.isfile(os.path.join(folder, n))
                ]
                found.append(hits[0] if hits else None)
            if all(found):
                packed = [os.path.basename(p) for p in found if p and p.endswith(".gz")]
                if packed and not gz_ok:
                    raise MissingDataError(
                        f"workload {workload!r} reads the unpacked files; {folder} holds {', '.join(packed)}: "
                        f"unpack them there (gunzip) and run again"
                    )
                return cast(list[str], found)  # all found
            held = sum(p is not None for p in found)
            if held > closest[0]:
                closest = (held, folder, tuple(n for n, p in zip(names, found) if p is None))
    _missing(workload, data_dir, names, looked, (closest[1], closest[2]) if closest[1] else None, gz_ok)


# --------------------------------------------------------------------------------- MNIST-1D
def mnist1d(num_samples: int = 5000, seed: int = 0, cache_dir: str | None = None) -> tuple[Tensor, ...]:
    """MNIST-1D generated offline by ``mnist1d.data.make_dataset`` (80/20 split).

    Returns ``(x, y, x_test, y_test)`` with x float32 ``(N, 40)``. ``make_dataset`` seeds
    the global ``random``/``numpy`` generators; their state is restored afterwards so the
    caller's randomness is untouched. With ``cache_dir`` the arrays are kept in an ``.npz``
    there (generation takes a few seconds; survey ranks are fresh processes).
    """
    cache = None
    if cache_dir is not None:
        cache = os.path.join(cache_dir, f"mnist1d_n{num_samples}_seed{seed}.npz")
        if os.path.isfile(cache):
            with np.load(cache) as saved:
                return tuple(torch.from_numpy(saved[k]) for k in ("x", "y", "x_test", "y_test"))
    import mnist1d.data

    args = mnist1d.data.get_dataset_args()
    args.num_samples, args.seed = int(num_samples), int(seed)
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = mnist1d.data.make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    arrays = {
        "x": data["x"].astype(np.float32),
        "y": data["y"].astype(np.int64),
        "x_test": data["x_test"].astype(np.float32),
        "y_test": data["y_test"].astype(np.int64),
    }
    if cache is not None and cache_dir is not None and os.access(cache_dir, os.W_OK):
        partial = f"{cache}.{os.getpid()}.tmp.npz"  # atomic: ranks may write at once
        np.savez(partial, **arrays)
        os.replace(partial, cache)
    return tuple(torch.from_numpy(arrays[k]) for k in ("x", "y", "x_test", "y_test"))


# ---------------------------------------------------------------------------------- digits
def digits(seed: int = 0, test_fraction: float = 0.2) -> Splits:
    """scikit-learn's bundled 8x8 digits (1797 images), with a seeded random split.

    Pixels (0..16) are scaled to [0, 1] and standardised with the train split's mean/std.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(int(seed)))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


# ------------------------------------------------------------------------------------ MNIST
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def read_idx(path: str) -> np.ndarray:
    """Parse an IDX file (optionally gzipped): magic ``00 00 <dtype> <ndim>``, then ndim
    big-endian uint32 sizes, then the big-endian data."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            raw = handle.read()
    except (gzip.BadGzipFile, EOFError) as error:  # a truncated or mislabelled .gz
        raise GraceDataError(f"{path} is not a readable gzip file ({error}); unpack it by hand to see why") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise GraceDataError(
            f"{path} is not an IDX file (bad magic number {raw[:4].hex()}); "
            f"accepted: 00 00 <type in {sorted(_IDX_DTYPES)}> <ndim>"
        )
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise GraceDataError(f"{path}: the IDX header names {ndim} dimensions but the file ends after {len(raw)} bytes")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    offset = 4 + 4 * ndim
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - offset != expected:
        raise GraceDataError(
            f"{path}: header says shape {shape} ({expected} bytes of data) but the file holds {len(raw) - offset}"
        )
    return np.frombuffer(raw, dtype, offset=offset).reshape(shape).astype(dtype.newbyteorder("="))


def mnist(data_dir: str | None, workload: str = "mnist") -> Splits:
    """MNIST from IDX files in ``data_dir`` (or its ``mnist/`` or ``MNIST/raw/`` folder).

    Returns images as float32 ``(N, 1, 28, 28)`` normalised with the usual mean/std.
    """
    paths = _paths("mnist", data_dir, workload)
    train_x, train_y, test_x, test_y = (read_idx(p) for p in paths)
    for images, labels, split in ((train_x, train_y, "train"), (test_x, test_y, "t10k")):
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise GraceDataError(f"MNIST {split} files disagree: images {images.shape}, labels {labels.shape}")

    def images_to_tensor(images: np.ndarray) -> Tensor:
        x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
        return (x - MNIST_MEAN) / MNIST_STD

    return (
        images_to_tensor(train_x),
        torch.from_numpy(train_y.astype(np.int64)),
        images_to_tensor(test_x),
        torch.from_numpy(test_y.astype(np.int64)),
    )


# --------------------------------------------------------------------------------- CIFAR-10
CIFAR_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class _ArraysOnly(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays, nothing else: a CIFAR-10 batch is a dict
    of bytes keys, a uint8 array and lists; a crafted file naming any other callable (say
    ``os.system``) is refused instead of run."""

    ALLOWED = {
        (module, name)
        for module in ("numpy.core.multiarray", "numpy._core.multiarray")
        for name in ("_reconstruct", "scalar")
    } | {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),
    }  # how pickle protocol 2 writes bytes from Python 3

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing {module}.{name}: a CIFAR-10 batch holds only plain containers and numpy arrays"
            )
        return super().find_class(module, name)


def _cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as handle:
        try:
            batch = _ArraysOnly(handle, encoding="bytes").load()
            data = np.asarray(batch[b"data"], dtype=np.uint8)
            labels = np.asarray(batch[b"labels"], dtype=np.int64)
        except (pickle.UnpicklingError, EOFError, KeyError, TypeError, IndexError, ValueError) as error:
            plain = isinstance(error, pickle.UnpicklingError) and str(error)
            reason = str(error) if plain else f"{type(error).__name__}: {error}".rstrip(": ")
            raise GraceDataError(f"{path}: not a CIFAR-10 batch ({reason})") from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(labels):
        raise GraceDataError(
            f"{path}: expected b'data' uint8 (N, 3072) and N b'labels', got {data.shape} and {labels.shape}"
        )
    return data, labels


def cifar10(data_dir: str | None, workload: str = "cifar10") -> Splits:
    """CIFAR-10 from the python pickle batches in ``data_dir`` or ``data_dir/cifar-10-batches-py``.

    Returns images float32 ``(N, 3, 32, 32)`` normalised per channel.
    """
    paths = _paths("cifar10", data_dir, workload)
    train = [_cifar_batch(p) for p in paths[:5]]
    test_x, test_y = _cifar_batch(paths[5])
    mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)

    def images_to_tensor(data: np.ndarray) -> Tensor:
        x = torch.from_numpy(data).view(-1, 3, 32, 32).float().div_(255.0)
        return (x - mean) / std

    return (
        images_to_tensor(np.concatenate([d for d, _ in train])),
        torch.from_numpy(np.concatenate([lab for _, lab in train])),
        images_to_tensor(test_x),
        torch.from_numpy(test_y),
    )


def cifar_augment(images: Tensor, generator: torch.Generator) -> Tensor:
    """Random 32x32 crop of the 4-pixel-padded image plus random horizontal flip, for a
    whole batch at once (one gather), as in He et al. 2016.

    ``images``: normalised ``(B, C, H, W)`` on any device; ``generator``: a CPU
    ``torch.Generator`` (offsets are drawn on CPU so CPU and CUDA runs agree). Padding uses
    the normalised value of a black pixel, like padding the raw image with zeros.
    """
    batch, channels, height, width = images.shape
    pad = 4
    black = (-torch.tensor(CIFAR_MEAN) / torch.tensor(CIFAR_STD)).to(images)
    black = black[:channels] if channels <= 3 else torch.zeros(channels).to(images)
    padded = black.view(1, channels, 1, 1).expand(batch, channels, height + 2 * pad, width + 2 * pad).clone()
    padded[:, :, pad : pad + height, pad : pad + width] = images
    row0 = torch.randint(0, 2 * pad + 1, (batch,), generator=generator)
    col0 = torch.randint(0, 2 * pad + 1, (batch,), generator=generator)
    flip = torch.rand(batch, generator=generator) < 0.5
    rows = row0[:, None] + torch.arange(height)
    cols = torch.where(
        flip[:, None], col0[:, None] + torch.arange(width - 1, -1, -1), col0[:, None] + torch.arange(width)
    )
    device = images.device
    return padded[
        torch.arange(batch, device=device)[:, None, None, None],
        torch.arange(channels, device=device)[None, :, None, None],
        rows.to(device)[:, None, :, None],
        cols.to(device)[:, None, None, :],
    ]


# -------------------------------------------------------------------------------------- PTB
PTB_FILES = ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt")


def _ptb_words(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            return [word for line in handle for word in line.split() + ["<eos>"]]
    except UnicodeDecodeError as error:
        raise GraceDataError(
            f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); PTB files are plain text"
        ) from None


def _windows(tokens: Sequence[int], bptt: int) -> tuple[Tensor, Tensor]:
    """Non-overlapping ``(inputs, targets)`` windows: targets are inputs shifted by one token."""
    count = (len(tokens) - 1) // bptt
    stream = torch.tensor(tokens[: count * bptt + 1], dtype=torch.int64)
    return stream[:-1].view(count, bptt), stream[1:].view(count, bptt)


def ptb(
    data_dir: str | None, bptt: int = 35, workload: str = "ptb"
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor], tuple[Tensor, Tensor], list[str]]:
    """Word-level PTB-format text: vocabulary from the train split (words seen only in
    valid/test map to ``<unk>``), ``<eos>`` at each line end.

    Returns ``(train, valid, test, vocabulary)`` where each split is ``(inputs, targets)``
    int64 ``(N, bptt)`` and ``vocabulary`` is the list of words by id (ids by first
    appearance, so the mapping is deterministic).
    """
    paths = _paths("ptb", data_dir, workload)
    splits = [_ptb_words(p) for p in paths]
    vocabulary = list(dict.fromkeys(splits[0]))
    if "<unk>" not in vocabulary:
        vocabulary.append("<unk>")
    index = {word: i for i, word in enumerate(vocabulary)}
    unk = index["<unk>"]
    windows: list[tuple[Tensor, Tensor]] = []
    for name, words in zip(PTB_FILES, splits):
        if len(words) < bptt + 1:
            raise GraceDataError(f"{name} has {len(words)} tokens; need at least bptt+1={bptt + 1}")
        windows.append(_windows([index.get(w, unk) for w in words], bptt))
    return windows[0], windows[1], windows[2], vocabulary


# --------------------------------------------------------------------- which files, where
FILE_LAYOUTS = {  # dataset -> (its files, the folders of data_dir they may be in, in order)
    "mnist": (MNIST_FILES, ("", "mnist", "MNIST/raw")),
    "cifar10": (CIFAR_FILES, ("cifar-10-batches-py", "")),
    "ptb": (PTB_FILES, ("", "ptb", "simple-examples/data")),
}
GZ_ACCEPTED = ("mnist",)  # the others' .gz downloads must be unpacked first


def _paths(dataset: str, data_dir: str | None, workload: str) -> list[str]:
    files, subdirs = FILE_LAYOUTS[dataset]
    return _find(data_dir, files, subdirs, workload, gz_ok=dataset in GZ_ACCEPTED)


#: the survey workloads that read local files, and which dataset's
WORKLOAD_FILES = {"mnist-mlp": "mnist", "mnist-lenet5": "mnist", "cifar10-resnet20": "cifar10", "ptb-lstm": "ptb"}


def check_files(workload: str, data_dir: str | None) -> None:
    """Raise :class:`MissingDataError` if ``workload`` reads files that ``data_dir`` lacks;
    reads nothing (a check before a run creates its output folder). Generated workloads pass."""
    dataset = WORKLOAD_FILES.get(workload)
    if dataset is not None:
        _paths(dataset, data_dir, workload)


# ---------------------------------------------------------------------------- fc-heavy task
def teacher_task(
    train_samples: int,
    test_samples: int,
    input_dim: int = 1024,
    num_classes: int = 10,
    latent_dim: int = 16,
    noise: float = 0.5,
    seed: int = 0,
) -> Splits:
    """Synthetic classification labelled by a fixed random teacher.

    A latent z ~ N(0, I_16) is embedded in ``input_dim`` dimensions by a random matrix E
    plus isotropic noise, x = z E / 4 + 0.5 n, and labelled by a random linear teacher
    W: y = argmax(z W). The student must find the 16-dim subspace through the noise, so
    test accuracy rises over the first epochs (the 25M MLP reached 0.80 after one epoch and
    0.86 after two at batch 128, lr 0.01) instead of being trivial or unlearnable. All draws
    come from one seeded torch.Generator.
    """
    gen = torch.Generator().manual_seed(int(seed))
    embedding = torch.randn(latent_dim, input_dim, generator=gen) / latent_dim**0.5
    teacher = torch.randn(latent_dim, num_classes, generator=gen)
    total = train_samples + test_samples
    latent = torch.randn(total, latent_dim, generator=gen)
    x = latent @ embedding + noise * torch.randn(total, input_dim, generator=gen)
    y = (latent @ teacher).argmax(dim=1)
    return x[:train_samples], y[:train_samples], x[train_samples:], y[train_samples:]
