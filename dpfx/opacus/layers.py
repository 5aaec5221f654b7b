"""``opacus.layers``: Opacus's DP recurrent layers are torch's own in dpfx.

Opacus rewrites ``nn.LSTM`` as ``DPLSTM`` (cells of ``nn.Linear``) so that its hooks see every
time step. dpfx writes the recurrence out when it captures ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN``
and makes their weights' gradients per-sample there (capture/rnn.py, passes/stack_time.py), so
the names below are the torch classes, with the same constructor arguments.
"""
from torch import nn

DPLSTM = nn.LSTM
DPGRU = nn.GRU
DPRNN = nn.RNN

__all__ = ["DPLSTM", "DPGRU", "DPRNN"]
