"""The proofs dpfx makes before it hands a graph to Inductor: dpfx's trusted core.

    check_forward(fw_gm, an)                    # 1. no forward op mixes examples
    verify_backward(bw_gm, an, grads, config)   # 2. every gradient output is clipped and noised
    verify_block(gm, an, clipped, cuts, squares, rows)   # a compiled block's own clipped sums

A violation is a ``PrivacyError`` naming the op or the parameter. Each rule is written once,
in the module of what it proves, and every proof that needs it calls that function:

- ``forward.py``: invariant 1 (``mixing_ops``, rerun by the backward proof and the loss check);
- ``backward.py``: invariant 2, ``verify_backward`` running the checks below in sequence;
- ``clip.py``: a clip factor's form, and what may enter the clipped sum it scales;
- ``noise.py``: the noise's std and its slices, disjoint across parameters;
- ``release.py``: each output exactly (clipped sums + noise) / D;
- ``adaptive.py``: adaptive clipping's bound input and its released count;
- ``block.py``: a block's clipped sums, in the block's graph and in the model's;
- ``patterns.py``: the graph patterns and walks the proofs share.

See tests/passes/test_verifier.py, which hands the verifier broken graphs.
"""
from dpfx.passes.verify.backward import verify_backward
from dpfx.passes.verify.block import verify_block
from dpfx.passes.verify.forward import (attention_side_output, check_forward, forward_problems,
                                        mixing_ops, module_of)

__all__ = ["attention_side_output", "check_forward", "forward_problems", "mixing_ops",
           "module_of", "verify_backward", "verify_block"]
