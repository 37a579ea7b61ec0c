"""A small ResNet-style CNN on generated CIFAR-shaped data (3x32x32, 10 classes), learnable by design.

Each class has its own smooth colour pattern; an example is its class's pattern, randomly shifted and
scaled, plus noise. Nothing is downloaded. Run it:  fedshield simulate examples/scenarios/cifar-resnet.toml
"""

import numpy as np
import torch
from torch import nn

from clients import Dataset, Task

CLASSES, TRAIN, TEST = 10, 2000, 500


def cifar_like(n: int, seed: int, patterns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    shifts = rng.integers(-4, 5, (n, 2))
    x = np.empty((n, 3, 32, 32), np.float32)
    for i in range(n):  # (data generation, once per process; not a hot path)
        x[i] = np.roll(patterns[y[i]], tuple(shifts[i]), axis=(1, 2))
    x *= rng.uniform(0.7, 1.3, (n, 1, 1, 1)).astype(np.float32)
    x += rng.normal(0, 0.6, x.shape).astype(np.float32)
    return x, y


def class_patterns(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    u, v = np.meshgrid(np.linspace(0, 2 * np.pi, 32), np.linspace(0, 2 * np.pi, 32))
    out = np.empty((CLASSES, 3, 32, 32), np.float32)
    for k in range(CLASSES):
        fu, fv, phase = rng.integers(1, 4), rng.integers(1, 4), rng.uniform(0, 2 * np.pi, 3)
        for c in range(3):
            out[k, c] = np.sin(fu * u + phase[c]) * np.cos(fv * v + phase[(c + 1) % 3])
    return out


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


class ResNetMini(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(Block(width, width, 1), Block(width, 2 * width, 2), Block(2 * width, 4 * width, 2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)))


class CifarResNet(Task):
    num_classes = CLASSES
    input_shape = (3, 32, 32)

    def build_model(self) -> nn.Module:
        return ResNetMini()

    def load_data(self) -> tuple[Dataset, Dataset]:
        patterns = class_patterns(1234)  # the classes are the same whatever the split's seed
        seed = self.spec.data_seed
        return Dataset(*cifar_like(TRAIN, seed * 2 + 1, patterns)), Dataset(*cifar_like(TEST, seed * 2 + 2, patterns))
