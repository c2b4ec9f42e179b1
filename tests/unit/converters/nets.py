"""Tiny PyTorch models for the converter tests, built here (no downloads). `sluice convert`
loads them as `path/to/nets.py:build_cnn` or `tests.unit.converters.nets:build_cnn`."""

from __future__ import annotations

import torch


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.conv1(image)))
        logits: torch.Tensor = self.head(torch.relu(self.conv2(x)).mean(dim=(2, 3)))
        return logits


class SmallEncoder(torch.nn.Module):
    """A two-layer transformer encoder over token ids, pooled to 4 logits."""

    def __init__(self, vocab: int = 100, dim: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.encoder(self.embed(input_ids)).mean(dim=1))
        return logits


class TwoHeads(torch.nn.Module):
    """Two inputs sharing a dynamic `sequence` axis and a dict of two outputs."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sum": a + b, "dot": (a * b).sum(dim=1)}


class Sabotaged(torch.nn.Module):
    """Answers differently once exported: the converted model must fail validation."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.fc(x)
        return y * 2 if torch.onnx.is_in_onnx_export() else y


class Eigen(torch.nn.Module):
    """Uses an operator with no ONNX translation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values: torch.Tensor = torch.linalg.eigvals(x).real
        return values


def build_cnn() -> SmallCNN:
    torch.manual_seed(0)
    return SmallCNN().eval()


def build_encoder() -> SmallEncoder:
    torch.manual_seed(0)
    return SmallEncoder().eval()


def build_two_heads() -> TwoHeads:
    return TwoHeads()


def build_sabotaged() -> Sabotaged:
    torch.manual_seed(0)
    return Sabotaged()


def build_eigen() -> Eigen:
    return Eigen()


def build_number() -> int:
    return 3
