"""The tags dpfx puts on FX nodes, read by the layers above the one that wrote them.

    node.meta["custom"] = {LOSS: True}     # written by loss/captured.py
    is_loss(node)                          # read by passes/__init__.py
"""
from __future__ import annotations

import torch.fx as fx

LOSS = "dpfx_loss"


def is_loss(node: fx.Node) -> bool:
    """A node of the captured loss's gradient program (Note [The loss inside the graph] in
    loss/captured.py)."""
    custom = node.meta.get("custom")
    return isinstance(custom, dict) and bool(custom.get(LOSS))
