"""The README's code runs as written: its quickstart, the plain loop, make_private, user-level
DP and the clip functions, on a small model and dataset, through Inductor (the default)."""
import os
import re

import torch
import torch.nn as nn

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", open(README).read(), flags=re.S)


class Net(nn.Module):
    """An encoder and a head, as the per-layer clipping example names them."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.encoder(x))


def test_the_readme_examples_train():
    code = blocks()
    assert len(code) == 5, "the quickstart, the plain loop, make_private, users, clip functions"
    torch.manual_seed(0)
    x, y = torch.randn(512, 8), torch.randint(0, 3, (512,))
    scope = {"Net": Net,
             "train_set": torch.utils.data.TensorDataset(x, y),
             "author_ids": [i % 128 for i in range(512)]}       # 128 users of 4 examples
    for block in code:
        exec(compile(block, README, "exec"), scope)
    # make_private counted one accountant step per optimizer step
    assert scope["accountant"].steps == 10 * round(512 / 256)
    assert 0 < scope["accountant"].get_epsilon(1e-5) < 10
    # user-level: q = 64 / 128 users, round(1 / q) steps
    assert scope["private"].privacy_unit == "user" and scope["private"].accountant.steps == 2
