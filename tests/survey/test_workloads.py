"""Survey workloads: loaders on small files written in the real formats, model shapes and
sizes, offline generators, determinism and configuration errors."""

import gzip
import pickle
import random
import socket

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from grace_dgc.errors import GraceConfigError
from grace_survey.workloads import datasets, models
from grace_survey.workloads.registry import MissingDataError, get_workload, list_workloads, parameter_count

ALL = {
    "mnist1d-mlp",
    "mnist1d-cnn",
    "digits-mlp",
    "mnist-mlp",
    "mnist-lenet5",
    "cifar10-resnet20",
    "ptb-lstm",
    "fc-heavy",
    "pydoc-gpt",
}


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a workload tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


# ------------------------------------------------------------------ writers of the real formats
def write_idx(path, array, type_code=0x08):
    """IDX as specified on yann.lecun.com: 00 00 <type> <ndim>, big-endian uint32 dims, data."""
    big_endian = {0x08: ">u1", 0x0C: ">i4", 0x0D: ">f4"}[type_code]
    header = bytes([0, 0, type_code, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    raw = header + np.ascontiguousarray(array).astype(big_endian).tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as handle:
        handle.write(raw)


def write_mnist(folder, gz=False, n_train=20, n_test=10, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    for name, array in arrays.items():
        write_idx(folder / (name + (".gz" if gz else "")), array)
    return arrays


def write_cifar(folder, per_batch=4, n_test=3, seed=0):
    rng = np.random.default_rng(seed)
    folder = folder / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", n_test)]:
        batch = {
            b"batch_label": name.encode(),
            b"labels": rng.integers(0, 10, n).tolist(),
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"filenames": [b"x.png"] * n,
        }
        with open(folder / name, "wb") as handle:
            pickle.dump(batch, handle, protocol=2)
        batches[name] = batch
    return batches


PTB_TEXT = {
    "ptb.train.txt": " the cat sat on the mat \n the dog sat \n a cat ran on the mat \n",
    "ptb.valid.txt": " the dog ran \n the bird sat \n",
    "ptb.test.txt": " a dog sat on the mat \n the emu ran \n",
}


def write_ptb(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in PTB_TEXT.items():
        (folder / name).write_text(text)


# ------------------------------------------------------------------------------------- MNIST
@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_loader(tmp_path, gz):
    arrays = write_mnist(tmp_path, gz=gz)
    for name in ("mnist-mlp", "mnist-lenet5"):
        workload = get_workload(name, data_dir=str(tmp_path))
        x, y = workload.train
        assert x.shape == (20, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
        expected = (arrays["train-images-idx3-ubyte"].astype(np.float64) / 255 - 0.1307) / 0.3081
        np.testing.assert_allclose(x[:, 0].numpy(), expected, rtol=1e-5, atol=1e-5)
        assert y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
        assert workload.test[1].tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()
        assert workload.loss == "cross_entropy" and workload.info["num_classes"] <= 10
        torch.manual_seed(0)
        assert workload.make_model()(x[:3]).shape == (3, 10)


def test_mnist_torchvision_layout_and_idx_types(tmp_path):
    write_mnist(tmp_path / "MNIST" / "raw", n_train=5, n_test=5)
    assert get_workload("mnist-mlp", data_dir=str(tmp_path)).train[0].shape[0] == 5
    values = np.arange(-12, 12, dtype=np.int32).reshape(2, 3, 4) * 70000  # needs 4 bytes, signed
    write_idx(tmp_path / "ints.idx", values, type_code=0x0C)
    np.testing.assert_array_equal(datasets.read_idx(str(tmp_path / "ints.idx")), values)
    floats = np.linspace(-1, 1, 6, dtype=np.float32)
    write_idx(tmp_path / "floats.idx.gz", floats, type_code=0x0D)
    np.testing.assert_array_equal(datasets.read_idx(str(tmp_path / "floats.idx.gz")), floats)


def test_idx_rejects_bad_files(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x12\x34\x08\x01\x00\x00\x00\x01\x00")
    with pytest.raises(ValueError, match="magic"):
        datasets.read_idx(str(tmp_path / "bad"))
    write_idx(tmp_path / "short", np.zeros((4, 5), np.uint8))
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"shape \(4, 5\)"):
        datasets.read_idx(str(tmp_path / "short"))


def test_missing_files_name_what_is_expected(tmp_path):
    with pytest.raises(MissingDataError, match="train-images-idx3-ubyte.*no --data-dir given"):
        get_workload("mnist-mlp")
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((1, 28, 28), np.uint8))
    with pytest.raises(MissingDataError) as err:
        get_workload("mnist-lenet5", data_dir=str(tmp_path))
    assert "t10k-labels-idx1-ubyte" in str(err.value) and str(tmp_path) in str(err.value)
    assert "never downloads" in str(err.value)
    with pytest.raises(MissingDataError, match="data_batch_1.*test_batch"):
        get_workload("cifar10-resnet20", data_dir=str(tmp_path))
    with pytest.raises(MissingDataError, match="ptb.train.txt"):
        get_workload("ptb-lstm", data_dir=str(tmp_path))
    assert issubclass(MissingDataError, FileNotFoundError)


# ------------------------------------------------------------------------------------ CIFAR
def test_cifar_pickle_loader(tmp_path):
    batches = write_cifar(tmp_path)
    workload = get_workload("cifar10-resnet20", data_dir=str(tmp_path))
    x, y = workload.train
    assert x.shape == (20, 3, 32, 32) and workload.test[0].shape == (3, 3, 32, 32)
    raw = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
    labels = sum((batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)), [])
    assert y.tolist() == labels
    # the row is R then G then B planes, each 32x32 row-major
    for image, channel, row, col in [(0, 0, 0, 0), (7, 1, 5, 31), (19, 2, 31, 9)]:
        value = raw[image, channel * 1024 + row * 32 + col] / 255
        expected = (value - datasets.CIFAR_MEAN[channel]) / datasets.CIFAR_STD[channel]
        assert x[image, channel, row, col].item() == pytest.approx(expected, abs=1e-5)
    assert workload.augment is datasets.cifar_augment
    assert (workload.weight_decay, workload.batch_size, workload.target_accuracy) == (1e-4, 128, 0.85)


def test_cifar_augment_matches_per_image_reference():
    images = torch.randn(16, 3, 32, 32)
    out = datasets.cifar_augment(images, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)  # same draws, same order: rows, cols, flips
    rows, cols = torch.randint(0, 9, (16,), generator=gen), torch.randint(0, 9, (16,), generator=gen)
    flips = torch.rand(16, generator=gen) < 0.5
    black = [-m / s for m, s in zip(datasets.CIFAR_MEAN, datasets.CIFAR_STD)]
    for b in range(16):
        padded = torch.stack([F.pad(images[b, c], (4, 4, 4, 4), value=black[c]) for c in range(3)])
        crop = padded[:, rows[b] : rows[b] + 32, cols[b] : cols[b] + 32]
        torch.testing.assert_close(out[b], crop.flip(-1) if flips[b] else crop, rtol=0, atol=1e-6)
    assert 0 < flips.sum() < 16
    again = datasets.cifar_augment(images, torch.Generator().manual_seed(3))
    assert torch.equal(out, again)


# -------------------------------------------------------------------------------------- PTB
def test_ptb_text_loader_and_lstm(tmp_path):
    write_ptb(tmp_path / "ptb")
    workload = get_workload("ptb-lstm", data_dir=str(tmp_path), bptt=4)
    vocab = workload.info["vocabulary"]
    train_words = PTB_TEXT["ptb.train.txt"].replace("\n", " <eos> ").split()
    assert vocab[: len(dict.fromkeys(train_words))] == list(dict.fromkeys(train_words))
    assert "<unk>" in vocab and "emu" not in vocab and "bird" not in vocab
    ids = [vocab.index(w) for w in train_words]
    x, y = workload.train
    count = (len(ids) - 1) // 4
    assert x.shape == y.shape == (count, 4) and x.dtype == torch.int64
    assert x.flatten().tolist() == ids[: count * 4] and y.flatten().tolist() == ids[1 : count * 4 + 1]
    test_words = PTB_TEXT["ptb.test.txt"].replace("\n", " <eos> ").split()
    expected_test = [vocab.index(w) if w in vocab else vocab.index("<unk>") for w in test_words]
    assert workload.test[0].flatten().tolist() == expected_test[: workload.test[0].numel()]
    assert workload.valid[0].shape[1] == 4
    assert workload.loss == "lm" and workload.grad_clip == 5.0
    torch.manual_seed(0)
    model = workload.make_model()
    assert model(x[:3]).shape == (3, 4, len(vocab))
    embed, hidden, vocab_size = 200, 200, len(vocab)
    lstm = sum(4 * hidden * (n_in + hidden) + 8 * hidden for n_in in (embed, hidden))
    assert workload.parameters == vocab_size * embed + lstm + hidden * vocab_size + vocab_size


# ----------------------------------------------------------------------------- model sizes
def resnet_cifar_parameters(n, widths=(16, 32, 64), classes=10):
    """Weights of ResNet-(6n+2) with option-A (parameter-free) shortcuts, BN gamma+beta."""
    total = 3 * 3 * 3 * widths[0] + 2 * widths[0]
    previous = widths[0]
    for width in widths:
        for i in range(n):
            total += 9 * (previous if i == 0 else width) * width + 9 * width * width + 4 * width
        previous = width
    return total + widths[-1] * classes + classes


def test_resnet20_is_the_paper_network():
    model = models.resnet20()
    assert parameter_count(model) == resnet_cifar_parameters(3) == 269_722
    assert parameter_count(models.ResNetCifar(5)) == resnet_cifar_parameters(5)  # ResNet-32
    assert sum(isinstance(m, torch.nn.Conv2d) for m in model.modules()) == 19  # + fc = 20 layers
    model.eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_lenet5_and_mlp_sizes():
    assert parameter_count(models.LeNet5()) == (6 * 25 + 6) + (16 * 6 * 25 + 16) + (400 * 120 + 120) + (
        120 * 84 + 84
    ) + (84 * 10 + 10)
    assert models.LeNet5()(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    sizes = [784, 256, 128, 10]
    assert parameter_count(models.mlp(sizes)) == models.mlp_parameter_count(sizes) == 235_146


def test_fc_heavy_has_25m_parameters_and_a_learnable_task():
    workload = get_workload("fc-heavy", train_samples=512, test_samples=128)
    sizes = (1024, 4096, 4096, 1024, 10)
    expected = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
    assert workload.parameters == expected == 25_185_290
    assert f"{expected:,} parameters" in workload.description
    assert workload.train[0].shape == (512, 1024) and workload.test[0].shape == (128, 1024)
    assert set(workload.train[1].tolist()) == set(range(10))
    torch.manual_seed(0)
    model = workload.make_model()  # the one build of the 25M model in this file
    assert parameter_count(model) == expected
    assert model(workload.test[0][:2]).shape == (2, 10)
    same = get_workload("fc-heavy", train_samples=512, test_samples=128)
    assert torch.equal(same.train[0], workload.train[0]) and torch.equal(same.test[1], workload.test[1])


def test_fc_heavy_task_is_learnable_by_a_linear_probe():
    x, y, x_test, y_test = datasets.teacher_task(2048, 512, seed=1)
    one_hot = F.one_hot(y, 10).float()  # ridge regression onto the labels, closed form
    weight = torch.linalg.solve(x.T @ x + 3000 * torch.eye(1024), x.T @ one_hot)
    accuracy = ((x_test @ weight).argmax(1) == y_test).float().mean().item()
    assert accuracy > 0.6  # chance is ~0.1; the labels are a function of the inputs
    shuffled = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(0))]
    weight = torch.linalg.solve(x.T @ x + 3000 * torch.eye(1024), x.T @ F.one_hot(shuffled, 10).float())
    assert ((x_test @ weight).argmax(1) == y_test).float().mean().item() < 0.35


# ------------------------------------------------------------------------ offline workloads
def test_mnist1d_offline_shapes(no_network):
    workload = get_workload("mnist1d-cnn")
    assert workload.train[0].shape == (4000, 40) and workload.test[0].shape == (1000, 40)
    assert workload.train[0].dtype == torch.float32 and workload.train[1].dtype == torch.int64
    assert set(workload.train[1].tolist()) == set(range(10))
    assert abs(torch.cat([workload.train[0], workload.test[0]]).std().item() - 1) < 1e-3
    for name in ("mnist1d-mlp", "mnist1d-cnn"):
        torch.manual_seed(0)
        assert get_workload(name, num_samples=100).make_model()(workload.test[0][:5]).shape == (5, 10)


def test_mnist1d_is_seeded_and_leaves_global_rngs_alone(tmp_path, no_network):
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    states = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    first = get_workload("mnist1d-mlp", seed=1, num_samples=300)
    assert random.getstate() == states[0]
    assert np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])
    again = get_workload("mnist1d-mlp", seed=1, num_samples=300)
    other = get_workload("mnist1d-mlp", seed=2, num_samples=300)
    pinned = get_workload("mnist1d-mlp", seed=2, num_samples=300, data_seed=1)
    assert torch.equal(first.train[0], again.train[0]) and torch.equal(first.test[1], again.test[1])
    assert torch.equal(first.train[0], pinned.train[0])
    assert not torch.equal(first.train[0], other.train[0])
    cached = get_workload("mnist1d-mlp", seed=1, num_samples=300, data_dir=str(tmp_path))
    assert (tmp_path / "mnist1d_n300_seed1.npz").is_file()
    reloaded = get_workload("mnist1d-mlp", seed=1, num_samples=300, data_dir=str(tmp_path))
    assert torch.equal(cached.train[0], first.train[0]) and torch.equal(reloaded.train[0], first.train[0])


def test_digits_offline(no_network):
    from sklearn.datasets import load_digits

    workload = get_workload("digits-mlp", seed=0)
    x, y = workload.train
    assert x.shape == (1438, 64) and workload.test[0].shape == (359, 64)
    counts = torch.bincount(torch.cat([y, workload.test[1]]), minlength=10)
    assert counts.tolist() == np.bincount(load_digits().target).tolist()
    again, other = get_workload("digits-mlp", seed=0), get_workload("digits-mlp", seed=1)
    assert torch.equal(again.train[0], x) and not torch.equal(other.train[1], y)
    torch.manual_seed(0)
    assert workload.make_model()(x[:4]).shape == (4, 10)


@pytest.mark.parametrize("name", ["mnist1d-mlp", "mnist1d-cnn", "digits-mlp"])
def test_same_seed_same_init(name):
    workload = get_workload(name, num_samples=100) if name.startswith("mnist1d") else get_workload(name)
    torch.manual_seed(7)
    first = workload.make_model().state_dict()
    torch.manual_seed(7)
    second = workload.make_model().state_dict()
    torch.manual_seed(8)
    third = workload.make_model().state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], third[k]) for k in first)


# ------------------------------------------------------------------------- configuration
def test_names_overrides_and_errors():
    assert set(list_workloads()) == ALL
    with pytest.raises(GraceConfigError, match="Did you mean 'digits-mlp'"):
        get_workload("digit-mlp")
    with pytest.raises(GraceConfigError, match="does not accept bptt; accepted: batch_size"):
        get_workload("digits-mlp", bptt=3)
    with pytest.raises(GraceConfigError, match="batch_size=0 is out of range"):
        get_workload("digits-mlp", batch_size=0)
    with pytest.raises(GraceConfigError, match="train_samples=5000 is out of range"):
        get_workload("digits-mlp", train_samples=5000)
    workload = get_workload("digits-mlp", lr=0.2, epochs=3, train_samples=100, test_samples=50, lr_milestones=[2])
    assert (workload.lr, workload.epochs, workload.lr_milestones) == (0.2, 3, (2,))
    assert len(workload.train[0]) == len(workload.train[1]) == 100 and len(workload.test[0]) == 50
    assert workload.info["train_size"] == 100 and workload.parameters == 64 * 128 + 128 + 128 * 10 + 10
