"""Per-block private graphs: a repeated block of the model compiled once, called as one op.

A deep model is mostly the same block many times (a decoder layer). ``compile_block`` captures
one instance with a symbolic batch, proves its forward keeps examples apart, rewrites its
backward per sample and splits it at the clip coefficient (``passes/block.py``), lowers the
three graphs with Inductor and registers them under a key (``ops/blocks.py``). Every block with
the same class, parameter and buffer shapes and the same non-tensor call arguments shares that
key: the capture, the rewrite, the proof and the lowering run once per distinct block, not once
per layer. ``install`` makes each instance's ``forward`` call ``dpfx::block_fwd`` with its own
tensors, so a graph captured around the blocks holds one op per block, not its layers. Only
the compiling model's private forward takes that path; any other call of the block runs its own
forward (Note [Only dpfx's own forward calls a compiled block]).

    dpfx.compile(model, ..., blocks="auto")   # prepare() at the first call, then as ever

# Note [Per-block private graphs]
The model's own graph (embeddings, head, loss) is captured, rewritten, proven and self-checked
as before; each block call in it is one ``dpfx::block_fwd`` in the forward and, in the backward,
one ``dpfx::block_bwd`` (input gradients, the block parameters' squared per-sample norms, the
book-keeping operands) and one ``dpfx::block_grad`` per call. The per-sample rewrite treats
``block_grad`` as the frontier of the block's parameters (rules/block.py): their norms join
the model's norm sum, the model's one clip factor (per group) scales them through
``dpfx::block_clip``, and the noise is added once, by the model's graph, as for any other
parameter. The proof is in two parts: the block's (passes/verify/block.py, verify_block: each of its
clipped sums is scaled by its coefficient input and masked by its finite input, over operands
its norm is taken over) and the model's (Note [A block's clipped sums] in passes/verify/block.py:
those inputs are this graph's clip coefficient and mask for the parameter's group, the operands
are one block call's, and that call's norm row is in the factor's norm).

Which tensors carry the batch: the model runs eagerly twice first, at 2 and at 3 examples (the
user's rows repeated), under ``torch.compiler.is_compiling()`` so that its code takes the path it
takes under dynamo; a block argument whose dim 0 follows (2, 3) carries the batch, one whose
shape stays is shared by every example (and may not need a gradient), anything else is refused.

Book-keeping, not a second backward: part A keeps each block's operands (its layers' inputs and
output gradients, or a materialized per-sample gradient) until the model's factor is known, then
part B forms the clipped sums. Opacus's alternative for sharded models (a second backward with
the loss reweighted by the factors) recomputes every block's backward; book-keeping costs the
operands' memory until the end of the backward instead. Measured figures are in BENCHMARKS.md.

A block that is an FSDP2 unit keeps its parameters sharded outside its ops and hands its
clipped sums to a reduce-scatter (Note [Sharded blocks] in loop/fsdp.py).

Not yet: blocks that draw random numbers in training (dropout), arguments other than tensors
and constants in the private forward (a key/value cache that already holds positions; an empty
one is dropped: Note [An empty cache is no argument]), a block used more than once (Note [A
block used more than once is refused]).
"""
from dpfx.blocks.call import BlockCall, PrivateForward, install, new_owner, uninstall
from dpfx.blocks.capture import compile_block
from dpfx.blocks.prepare import block_signature, prepare, select

__all__ = ["BlockCall", "PrivateForward", "block_signature", "compile_block", "install",
           "new_owner", "prepare", "select", "uninstall"]
