"""``nn.RNN``, ``nn.GRU`` and ``nn.LSTM`` written out in plain torch ops while dpfx captures a model.

    lstm = nn.LSTM(16, 32, num_layers=2, bidirectional=True, batch_first=True)
    out, (h_n, c_n) = lstm(x)          # under dpfx: rnn_forward(lstm, x), same values

torch runs a recurrent module as one fused kernel (``_VF.lstm``, on CPU ``mkldnn_rnn_layer``) that
dynamo refuses to trace ("Attempted to wrap RNN, GRU, or LSTM") and whose gradient has no
per-sample rule. ``rnn_forward`` computes the same recurrence with ``F.linear`` and pointwise gates,
one Python step per time step (T is static), so the weights' gradients are ordinary ``mm``s: the
input weight's one ``mm`` over T*B (the input projection of the whole sequence at once), the hidden
weight's a sum over time of T ``mm``s over B, which ``passes/stack_time.py`` stacks into one
``mm`` over B*T before the per-sample rewrite. torch's semantics, number for number (tests/capture/test_rnn.py checks the outputs
against the stock module, train and eval):

- LSTM gates in the order i, f, g, o; ``c' = f*c + i*g``, ``h' = o*tanh(c')``, then ``W_hr`` when
  ``proj_size > 0``.
- GRU gates r, z, n, with ``b_hn`` inside the reset product: ``n = tanh(W_in x + b_in + r*(W_hn h +
  b_hn))``, ``h' = (1 - z)*n + z*h``.
- RNN: ``tanh`` or ``relu`` of ``W_ih x + b_ih + W_hh h + b_hh``.
- Dropout on every layer's output but the last, in training; the reverse direction of a
  bidirectional layer reads the sequence from the end; h_n is indexed ``layer * D + direction``.

Packed input (# Note [Packed sequences as padded data and lengths]): ``pack_padded_sequence`` is
swapped for one that keeps the padded tensor and the lengths (``Packed``); the recurrence then
freezes each example's state past its length and writes zeros there, which is what torch computes
for a packed batch: h_n is each sequence's state at its own last step (its first, for the reverse
direction), and ``pad_packed_sequence(..., total_length=T)`` gives torch's padded output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils import rnn as rnn_utils

_pack_padded_sequence = rnn_utils.pack_padded_sequence
_pad_packed_sequence = rnn_utils.pad_packed_sequence


# Note [Packed sequences as padded data and lengths]
# A PackedSequence's size is sum(lengths), a function of the data, which cannot be traced with a
# symbolic batch. Under dpfx, pack_padded_sequence returns a Packed: the padded batch, time-major,
# and the lengths. Only dpfx's recurrent modules and pad_packed_sequence read it. pad_packed_sequence
# needs total_length: without it torch's output has max(lengths) steps, a size that depends on the
# data. Unlike torch, unsorted lengths with enforce_sorted=True are not refused (the result is the
# one enforce_sorted=False gives), nor are zero lengths (such a sequence keeps its initial state).
class Packed:
    """A packed batch as dpfx captures it: ``padded`` is (T, B, *), ``lengths`` (B,) int64."""

    def __init__(self, padded: torch.Tensor, lengths: torch.Tensor):
        self.padded = padded
        self.lengths = lengths


def pack_padded_sequence(input, lengths, batch_first=False, enforce_sorted=True):
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
    padded = input.transpose(0, 1) if batch_first else input
    return Packed(padded, lengths.to(device=input.device, dtype=torch.int64))


def pad_packed_sequence(sequence, batch_first=False, padding_value=0.0, total_length=None):
    if not isinstance(sequence, Packed):
        return _pad_packed_sequence(sequence, batch_first, padding_value, total_length)
    steps = sequence.padded.shape[0]
    if total_length is None or total_length < steps:
        raise ValueError(
            f"dpfx: pad_packed_sequence needs total_length={steps} (the padded length, "
            f"e.g. x.size(1)): without it the output has max(lengths) steps, a size that depends "
            f"on the data, which dpfx cannot capture")
    out = sequence.padded
    if padding_value != 0:
        running = torch.stack(_step_masks(sequence.lengths, steps))
        for _ in range(out.dim() - 2):
            running = running.unsqueeze(-1)
        out = torch.where(running, out, padding_value)
    if total_length > steps:
        out = F.pad(out, [0, 0] * (out.dim() - 1) + [0, total_length - steps],
                    value=padding_value)
    return (out.transpose(0, 1) if batch_first else out), sequence.lengths


def _step_masks(lengths: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """(B,) bool per step: example b's sequence is still running at step t."""
    return [t < lengths for t in range(steps)]


# -- the cells: one time step, given the input projection W_ih x_t + b_ih ------------------------
def _lstm_cell(xw, state, w_hh, b_hh, w_hr):
    h, c = state
    i, f, g, o = (xw + F.linear(h, w_hh, b_hh)).chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return (h if w_hr is None else F.linear(h, w_hr)), c


def _gru_cell(xw, h, w_hh, b_hh, w_hr):
    x_r, x_z, x_n = xw.chunk(3, -1)
    h_r, h_z, h_n = F.linear(h, w_hh, b_hh).chunk(3, -1)
    r = torch.sigmoid(x_r + h_r)
    z = torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    return (1 - z) * n + z * h


def _tanh_cell(xw, h, w_hh, b_hh, w_hr):
    return torch.tanh(xw + F.linear(h, w_hh, b_hh))


def _relu_cell(xw, h, w_hh, b_hh, w_hr):
    return torch.relu(xw + F.linear(h, w_hh, b_hh))


_CELLS = {"LSTM": _lstm_cell, "GRU": _gru_cell, "RNN_TANH": _tanh_cell, "RNN_RELU": _relu_cell}


def _hidden(state):
    return state[0] if isinstance(state, tuple) else state


def _hold(valid, new, old):
    """The new state where the sequence runs, the old one past its end."""
    if isinstance(new, tuple):
        return tuple(_hold(valid, n, o) for n, o in zip(new, old))
    return torch.where(valid, new, old)


def _direction(module, cell, x, suffix, state, reverse, valid):
    """One direction of one layer over the time-major x (T, B, I): outputs (T, B, H), state."""
    param = lambda kind: getattr(module, f"{kind}{suffix}", None)  # noqa: E731
    xw = F.linear(x, param("weight_ih"), param("bias_ih"))   # the whole sequence in one matmul
    w_hh, b_hh, w_hr = param("weight_hh"), param("bias_hh"), param("weight_hr")
    steps = x.shape[0]
    outs = [None] * steps
    for t in (reversed(range(steps)) if reverse else range(steps)):
        new = cell(xw[t], state, w_hh, b_hh, w_hr)
        if valid is None:
            state, outs[t] = new, _hidden(new)
        else:
            running = valid[t].unsqueeze(-1)
            state = _hold(running, new, state)
            outs[t] = torch.where(running, _hidden(new), 0.0)
    return torch.stack(outs), state


def rnn_forward(self, input, hx=None):
    """``forward`` of nn.RNN / nn.GRU / nn.LSTM (what dpfx traces in their place)."""
    cell = _CELLS[self.mode]
    lstm = self.mode == "LSTM"
    packed = isinstance(input, Packed)
    if packed:
        x, valid = input.padded, _step_masks(input.lengths, input.padded.shape[0])
    else:
        x, valid = (input.transpose(0, 1) if self.batch_first else input), None
    unbatched = x.dim() == 2
    if unbatched:
        x = x.unsqueeze(1)
        hx = None if hx is None else (tuple(h.unsqueeze(1) for h in hx) if lstm
                                      else hx.unsqueeze(1))
    directions = 2 if self.bidirectional else 1
    layers = self.num_layers * directions
    out_size = self.proj_size if self.proj_size > 0 else self.hidden_size
    if hx is None:
        zeros = lambda size: x.new_zeros(layers, x.shape[1], size)  # noqa: E731
        hx = (zeros(out_size), zeros(self.hidden_size)) if lstm else zeros(out_size)
    final = []
    for layer in range(self.num_layers):
        outs = []
        for d in range(directions):
            k = layer * directions + d
            state = (hx[0][k], hx[1][k]) if lstm else hx[k]
            out, state = _direction(self, cell, x, f"_l{layer}" + ("_reverse" if d else ""),
                                    state, d == 1, valid)
            outs.append(out)
            final.append(state)
        x = outs[0] if directions == 1 else torch.cat(outs, -1)
        if self.dropout and self.training and layer < self.num_layers - 1:
            x = F.dropout(x, self.dropout, True)
    if lstm:
        h_n = (torch.stack([s[0] for s in final]), torch.stack([s[1] for s in final]))
    else:
        h_n = torch.stack(final)
    if unbatched:
        return x.squeeze(1), (tuple(h.squeeze(1) for h in h_n) if lstm else h_n.squeeze(1))
    if packed:
        return Packed(x, input.lengths), h_n
    return (x.transpose(0, 1) if self.batch_first else x), h_n
