"""Synthetic data in place of the examples' downloads, and the loss both runs are scored by.

Each class has its own pattern, so a few DP-SGD steps lower the loss: the point is that the
loop trains the same way under Opacus and dpfx, not what it reaches.
"""
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset


def images(n: int, shape: tuple, classes: int = 10, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(classes, *shape, generator=g)
    labels = torch.randint(classes, (n,), generator=g)
    x = prototypes[labels] + 0.5 * torch.randn(n, *shape, generator=g)
    return TensorDataset(x, labels)


def token_reviews(n: int, vocab: int, length: int, seed: int = 0) -> list[dict]:
    """IMDB-like records ({"input_ids", "label"}); each label draws its tokens from its own half
    of the vocabulary, one length for all (one compiled shape)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(2, (n,), generator=g)
    half = vocab // 2
    ids = torch.randint(1, half, (n, length), generator=g) + labels[:, None] * (half - 1)
    return [{"input_ids": ids[i], "label": labels[i]} for i in range(n)]


def name_files(root, languages: int = 4, per_language: int = 80, length: int = 8, seed: int = 0):
    """One file of names per "language" (NamesDataset's layout); each language has its own
    letters, every name the same length."""
    g = torch.Generator().manual_seed(seed)
    for lang in range(languages):
        letters = "abcdefghijklmnopqrstuvwxyz"[lang * 6:lang * 6 + 6]
        picks = torch.randint(len(letters), (per_language, length), generator=g).tolist()
        rows = ["".join(letters[i] for i in row).capitalize() for row in picks]
        (root / f"lang{lang}.txt").write_text("\n".join(rows) + "\n")


@torch.no_grad()
def mean_loss(model: nn.Module, loader) -> float:
    """Cross-entropy over a fixed loader, the model in eval mode (restored after)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in loader:
        total += nn.functional.cross_entropy(model(x), y, reduction="sum").item()
        count += len(y)
    model.train(was_training)
    return total / count
