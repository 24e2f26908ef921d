"""Models of the survey workloads. Each draws its initial weights from the global torch RNG
only, so ``torch.manual_seed(seed); make_model()`` gives the same model on every rank and
for every compression method."""

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn


def parameter_count(model: nn.Module) -> int:
    """Number of trainable scalars (what gradient compression has to move each step)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def mlp(sizes: Sequence[int]) -> nn.Sequential:
    """Flatten, then Linear+ReLU layers through ``sizes`` (no ReLU after the last)."""
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class CNN1D(nn.Module):
    """The MNIST-1D paper's ConvBase: three stride-2 1-D convolutions (25 channels), then a
    linear classifier; input ``(N, 40)``."""

    def __init__(self, length: int = 40, channels: int = 25, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        out = length
        for kernel in (5, 3, 3):  # each conv maps length L to (L + 2 - kernel) // 2 + 1
            out = (out + 2 - kernel) // 2 + 1
        self.linear = nn.Linear(channels * out, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = x.reshape(x.shape[0], 1, -1)
        h = F.relu(self.conv1(h))
        h = F.relu(self.conv2(h))
        h = F.relu(self.conv3(h))
        return self.linear(h.flatten(1))


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998) for 28x28 inputs, with the modern ReLU and max-pooling:
    conv 6@5x5 (pad 2) → pool → conv 16@5x5 → pool → 120 → 84 → 10."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        h = F.relu(self.fc1(h.flatten(1)))
        return self.fc3(F.relu(self.fc2(h)))


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with an identity shortcut; where the shape changes, the
    shortcut is option A of He et al. 2016: subsample by 2 and zero-pad the new channels
    (parameter-free, which is why ResNet-20 has 0.27M parameters)."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride, self.extra = stride, planes - in_planes

    def shortcut(self, x: Tensor) -> Tensor:
        if self.stride == 1 and self.extra == 0:
            return x
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetCifar(nn.Module):
    """ResNet-(6n+2) for CIFAR (He et al. 2016, section 4.2): 3x3 conv 16, three stages of n
    basic blocks at 16/32/64 channels (stride 2 entering stages 2 and 3), global average
    pooling, linear. n=3 is ResNet-20. Convs use He (Kaiming normal) initialisation."""

    def __init__(self, blocks_per_stage: int = 3, num_classes: int = 10, widths: Sequence[int] = (16, 32, 64)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        blocks: list[nn.Module] = []
        in_planes = widths[0]
        for stage, planes in enumerate(widths):
            for i in range(blocks_per_stage):
                blocks.append(BasicBlock(in_planes, planes, 2 if stage > 0 and i == 0 else 1))
                in_planes = planes
        self.blocks = nn.Sequential(*blocks)
        self.linear = nn.Linear(widths[-1], num_classes)
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(
                    module.weight, mode="fan_out" if isinstance(module, nn.Conv2d) else "fan_in", nonlinearity="relu"
                )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.blocks(out)
        return self.linear(F.adaptive_avg_pool2d(out, 1).flatten(1))


def resnet20(num_classes: int = 10) -> ResNetCifar:
    return ResNetCifar(3, num_classes)


class LSTMLanguageModel(nn.Module):
    """Word-level LM, the "small" configuration of Zaremba et al. 2014: embedding 200, two
    LSTM layers of 200, a separate (untied) decoder, weights uniform in [-0.1, 0.1], no
    dropout. Input ``(N, bptt)`` token ids → logits ``(N, bptt, vocab)``. Each window
    starts from a zero state (the survey shuffles windows, so no state is carried)."""

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int = 200,
        hidden_size: int = 200,
        num_layers: int = 2,
        init_range: float = 0.1,
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden_size, num_layers, batch_first=True)
        self.decoder = nn.Linear(hidden_size, vocab_size)
        for param in self.parameters():
            nn.init.uniform_(param, -init_range, init_range)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden, _ = self.lstm(self.embedding(tokens))
        return self.decoder(hidden)


def fc_heavy(sizes: Sequence[int] = (1024, 4096, 4096, 1024, 10)) -> nn.Sequential:
    """The fully-connected-heavy network (~25M parameters): an MLP whose gradient is
    dominated by two dense 4096-wide layers, where compression pays most."""
    return mlp(list(sizes))


def mlp_parameter_count(sizes: Sequence[int]) -> int:
    """Parameters of ``mlp(sizes)`` by formula (weights + biases), without building it."""
    return sum(n_in * n_out + n_out for n_in, n_out in zip(sizes[:-1], sizes[1:]))
