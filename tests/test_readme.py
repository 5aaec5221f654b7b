"""The README's code runs as written: its quickstart, the plain loop and make_private, on a
small model and dataset, through Inductor (the default)."""
import os
import re

import torch
import torch.nn as nn

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", open(README).read(), flags=re.S)


def test_the_readme_examples_train():
    code = blocks()
    assert len(code) == 3, "the quickstart, the plain loop and make_private"
    torch.manual_seed(0)
    x, y = torch.randn(512, 8), torch.randint(0, 3, (512,))
    scope = {"Net": lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)),
             "train_set": torch.utils.data.TensorDataset(x, y)}
    for block in code:
        exec(compile(block, README, "exec"), scope)
    # make_private counted one accountant step per optimizer step
    assert scope["accountant"].steps == 10 * round(512 / 256)
    assert 0 < scope["accountant"].get_epsilon(1e-5) < 10
