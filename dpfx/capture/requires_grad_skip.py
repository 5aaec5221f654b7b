"""``tensor.requires_grad = True`` inside a forward, skipped while dpfx captures.

Example: transformers' audio feature encoders (Wav2Vec2, HuBERT, WavLM, Data2VecAudio and the
models copied from them) begin with

    hidden_states = input_values[:, None]
    if self._requires_grad and self.training:
        hidden_states.requires_grad = True     # for gradient checkpointing

dynamo breaks the graph on a ``setattr`` of ``requires_grad`` (aot_autograd cannot turn a tensor
into a leaf in the middle of a graph), which dpfx must refuse: it never runs part of a model
outside its private graph. Like the logging calls dpfx skips (Note [Logging inside the forward]
in capture/entry.py), the statement is dropped from the capture.

# Note [Setting requires_grad inside the forward]
# Only ``t.requires_grad = True`` with the constant True is skipped; False (which detaches, and so
# changes gradients) and any computed value still break the graph and are refused. Nothing the
# model computes changes: a tensor's values do not depend on the flag, and the gradient of the
# loss with respect to each parameter does not depend on which other leaves require gradients
# (autograd only prunes the branches no one asked for). What the flag adds in eager is a
# gradient for ``t`` itself, which only its holder could read, and ``t`` is a tensor inside the
# model's forward; a parameter keeps its own flag. The captured graph is verified as any other
# (tests/graph/test_merged_batch.py::test_wav2vec2_requires_grad_inside_the_forward).
"""
from __future__ import annotations

from torch._dynamo.variables import ConstantVariable

try:    # torch 2.13 and later: the subclass dynamo makes for setattr
    from torch._dynamo.variables.builtin import SetAttrBuiltinVariable as _Owner
    _METHOD = "_call_setattr"
except ImportError:     # torch 2.11 (a GPU image's): BuiltinVariable's method, same arguments
    from torch._dynamo.variables.builtin import BuiltinVariable as _Owner
    _METHOD = "call_setattr"

_call_setattr = getattr(_Owner, _METHOD)


def _call_setattr_skipping_requires_grad(self, tx, obj, name_var, val):
    if (obj.is_tensor() and name_var.is_python_constant()
            and name_var.as_python_constant() == "requires_grad"
            and val.is_python_constant() and val.as_python_constant() is True):
        return ConstantVariable.create(None)
    return _call_setattr(self, tx, obj, name_var, val)


SWAP = (_Owner, _METHOD, _call_setattr_skipping_requires_grad)
