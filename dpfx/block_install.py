"""Installing a compiled module's blocks: at its first call, the blocks given to
``dpfx.compile(model, blocks=...)`` are compiled and installed on the model, then the call runs;
if either fails, the model's blocks are put back as they were.

    blocks = PendingBlocks(["layers.0", "layers.1"], chosen=False)
    out = blocks.install_and_run(call, args, kwargs, targets)   # call: compiled_call.CompiledCall

Note [Per-block private graphs] (blocks/) says what a block is; on a model sharded with
fully_shard, each unit is placed as its block is installed (Note [Sharded blocks] in
loop/fsdp.py).
"""
from __future__ import annotations

import warnings

from dpfx import blocks as blocks_mod
from dpfx.errors import CaptureError, UnsupportedOpError
from dpfx.loop.fsdp import BlocksFallbackWarning
from dpfx.loss.captured import TARGETS

# what refuses a block as it is compiled (See Note [A sharded model gets blocks by default])
BLOCKS_REFUSED = (CaptureError, UnsupportedOpError)


class PendingBlocks:
    """One compiled module's blocks: ``pending`` (the option) until its first call installs
    them, ``installed`` after. ``chosen``: compile() chose them for a sharded model (Note [A
    sharded model gets blocks by default]), so a block that cannot be falls back to one graph."""

    def __init__(self, pending, chosen: bool = False):
        self.pending = pending
        self.chosen = chosen
        self.installed: list = []

    def install_and_run(self, call, args: tuple, kwargs: dict, targets):
        """The first call with ``blocks=``: the blocks compiled and installed, then ``call``'s
        run; if either fails, the model's blocks are put back as they were."""
        pending = self.pending
        plain = {k: v for k, v in kwargs.items() if k != TARGETS}
        model, config, sharding = call.model, call.backend.config, call.sharding
        if sharding is None:
            installed = blocks_mod.prepare(model, pending, args, plain, config,
                                           owner=call.private_forward.token)
        else:       # Note [Sharded blocks] in loop/fsdp.py
            sharding.gather()
            try:
                with sharding.hooks_off():
                    installed = blocks_mod.prepare(
                        model, pending, args, plain, config,
                        places=lambda chosen: sharding.place_blocks(model, chosen),
                        owner=call.private_forward.token)
            except BLOCKS_REFUSED as refused:
                sharding.places.clear()
                if not self.chosen:
                    raise
                # See Note [A sharded model gets blocks by default]
                warnings.warn(BlocksFallbackWarning(
                    f"dpfx: the model's fully_shard units could not be compiled as blocks "
                    f"({refused}); it trains as one private graph, which holds every parameter "
                    f"unsharded during the step (the memory of the whole model on each rank). "
                    f"Pass blocks=False to choose that and silence this warning."), stacklevel=4)
                self.pending, self.chosen = None, False
                return call.run(args, kwargs,
                                targets if targets is None else kwargs.pop(TARGETS), None)
            except BaseException:
                sharding.places.clear()
                raise
            call.backend.released_elsewhere = {
                name for place in sharding.places.values() for name, _ in place.trainable}
        self.pending, self.installed = None, installed
        try:
            return call.run(args, kwargs, targets if targets is None else kwargs.pop(TARGETS),
                            None)
        except BaseException:
            for block in installed:
                blocks_mod.uninstall(block)
            self.pending, self.installed = pending, []
            if sharding is not None:
                sharding.places.clear()
                call.backend.released_elsewhere = set()
            raise
