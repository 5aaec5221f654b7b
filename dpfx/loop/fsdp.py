"""Models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): dpfx's private graph runs
on the gathered parameters, and ``DPOptimizer.step()`` reduce-scatters the clipped sums to the
ranks that own each shard, where each coordinate is noised once (Note [Sharded DP-SGD]).

# Note [Sharded DP-SGD]
A clip needs each example's norm over every parameter, so no shard can be clipped before all
of them are known. dpfx keeps its one private graph per model (the graph the verifier proves and
the self-check runs) and moves FSDP's collectives out of it:

- **Forward** (``DPModule.forward``): every FSDP unit is unsharded with FSDP's own
  ``unshard()`` (an all-gather of public values: the parameters are outputs of earlier private
  steps), and dpfx's compiled graph runs with FSDP's forward hooks set aside for the call, so
  dynamo captures the model as if it were not sharded, and FSDP neither reshards nor
  reduce-scatters anything behind dpfx's back. The gathered parameters are FSDP's own unsharded
  ``nn.Parameter`` objects, the same objects every step (FSDP frees and refills their storage),
  so dpfx's gradient guards and the captured graph stay bound to them. A forward without grad
  (evaluation) reshards right after the call.
- **Backward**: dpfx's graph leaves sum_i clip(g_i) of the rank's examples, one full-size tensor
  per parameter, in ``dp_model.clipped_sums`` (noise="optimizer" is required).
- **Step** (``DPOptimizer.step()``): the units are resharded (the gathered storage is freed and
  the sharded DTensor parameters are back on the modules); the clipped sums are laid out one row
  per destination rank (each parameter's chunk for that rank, padded to the parameter's largest
  chunk, then that rank's example count) and reduce-scattered with one collective; each rank adds
  N(0, sigma^2 S^2) to the coordinates it received, divides by D, and writes them as DTensor
  gradients with the shard's placement; the inner optimizer steps the shards.

Every coordinate is owned by one rank (FSDP's ``Shard`` placement over a 1-D mesh partitions
each parameter), so each is noised exactly once. Unlike the replicated path, where rank 0 noises
everything (Note [Noise once across ranks] in loop/optim.py), every rank draws the noise of its own
shard: the guarantee needs each rank's generator to be independent (OS-seeded by default; a
test's fixed ``seed`` is mixed with the rank so that no two shards share a stream).

What stays sharded: the parameters at rest, the gradients the optimizer sees, the optimizer
state. What does not, with one private graph for the whole model: during a step every rank
holds the whole model's parameters and its clipped sums (one full-size tensor per parameter),
like FSDP with the whole model as one unit.

# Note [Sharded blocks]
Compiled with ``blocks=`` (blocks/), a block that is an FSDP unit gets a ``Place`` (Note [A
block whose parameters live elsewhere] in ops/blocks.py), and a step's memory is bounded by the
largest unit instead of the model:

- the units that are not blocks (the root: embeddings, head) are gathered for the step as above;
  a block's unit is put on its module unsharded but empty (FSDP's unsharded ``nn.Parameter``
  objects, their storage freed), so the model's graph and its guards see the same objects;
- each of the block's ops (forward, the backward's part A) gathers the unit with one
  collective, as FSDP does: the unit's padded shards end to end are all-gathered at once and
  copied out into FSDP's own all-gather buffers (the unsharded parameters are views of them),
  one collective per dtype if the unit mixes dtypes; the buffers are freed after the op, so no
  unit is gathered beyond its op;
- once the model's clip factor is known, each block's part B forms its clipped sums, and the
  place reduce-scatters them at once (the unit's parameters in one collective, laid out as at
  the step) into this rank's float32 shard of each sum, accumulated over the backwards of a
  step; the model's graph outputs nothing for those parameters. ``DPOptimizer.step()`` then
  reduce-scatters the other clipped sums and noises this rank's coordinates of both.

Every rank runs the same graph, so every rank calls the same collectives in the same order
(an empty batch too). The first call (the capture, the blocks' compile and the self-checks)
gathers every unit; so does a forward without gradient.

Refused, with what to change: FSDP's mixed precision (``MixedPrecisionPolicy`` with a
``param_dtype`` or ``reduce_dtype``; use ``torch.autocast`` around the forward), CPU offload,
units over several modules (``fully_shard([a, b])``), and 2-D meshes (HSDP).
"""
from __future__ import annotations

import contextlib
import hashlib
import os

import torch
import torch.distributed as dist

from dpfx.errors import DPFXWarning


class BlocksFallbackWarning(DPFXWarning):
    """A sharded model's units could not be compiled as blocks, so it trains as one private
    graph holding every parameter unsharded (Note [A sharded model gets blocks by default] in
    api.py)."""


def units(model: torch.nn.Module) -> list:
    """The FSDP2 units inside ``model`` (itself included), in module order."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class Sharding:
    """The FSDP2 units of one compiled model, and the collectives dpfx runs for them."""

    def __init__(self, model: torch.nn.Module, found: list):
        self.units = found
        self._states = [_state_of(u, name) for name, u in _named_units(model, found)]
        mesh = self._mesh(model)
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()
        self.places: dict[int, Place] = {}      # id(unit) -> its Place (Note [Sharded blocks])
        self.early: dict[str, torch.Tensor] = {}    # this rank's shards of the blocks' sums

    def _mesh(self, model: torch.nn.Module):
        meshes = set()
        for name, p in model.named_parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is None:
                raise ValueError(
                    f"parameter '{name}' is not sharded: with FSDP, every parameter must belong "
                    f"to a fully_shard unit (call fully_shard on the root module too)")
            if mesh.ndim != 1:
                raise ValueError(
                    f"parameter '{name}' is sharded over a {mesh.ndim}-D mesh (HSDP); dpfx "
                    f"shards over a 1-D mesh: fully_shard(module, mesh=init_device_mesh(device, "
                    f"(world,)))")
            meshes.add(mesh)
        if len(meshes) != 1:
            raise ValueError("the model's FSDP units use different meshes; shard every unit "
                             "over the same 1-D mesh")
        return meshes.pop()

    # -- the forward -------------------------------------------------------------------------------
    def gather(self, blocks_empty: bool = False) -> None:
        """Every unit's parameters unsharded on the modules (a no-op for a unit that is); with
        ``blocks_empty``, a block's unit unsharded but empty (Note [Sharded blocks])."""
        for unit in self.units:
            place = self.places.get(id(unit)) if blocks_empty else None
            if place is None:
                unit.unshard()
            else:
                place.attach()

    def release(self) -> None:
        """Every unit back to its shards; the gathered storage is freed."""
        for unit in self.units:
            unit.reshard()

    @contextlib.contextmanager
    def hooks_off(self):
        """FSDP's forward hooks set aside for dpfx's compiled call (Note [Sharded DP-SGD])."""
        taken = []
        for unit, state in zip(self.units, self._states):
            for hooks in (unit._forward_pre_hooks, unit._forward_hooks):
                for key, hook in list(hooks.items()):
                    if getattr(hook, "__self__", None) is state:
                        taken.append((hooks, key, hook))
                        del hooks[key]
        try:
            yield
        finally:
            for hooks, key, hook in taken:
                hooks[key] = hook

    # -- the step ----------------------------------------------------------------------------------
    def check_same_structure(self) -> None:
        """The ranks shard one model: every rank must hold the same names, shapes and placements
        (the values differ by design: each rank holds its shards)."""
        mine = self._structure
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        if any(other != everyone[0] for other in everyone[1:]):
            raise ValueError("the ranks shard different models (parameter names, shapes or "
                             "placements differ); build and fully_shard the same model on every "
                             "rank before DPOptimizer")

    def check_own_path(self, path) -> None:
        """A checkpoint of a sharded model holds this rank's shards: every rank writes its own
        file (``torch.save`` of DTensors keeps the local shard and its placement)."""
        self.release()
        paths = [None] * self.world
        dist.all_gather_object(paths, os.path.abspath(os.fspath(path)), group=self.group)
        if len(set(paths)) != self.world:
            raise ValueError("every rank saves its own shards of a sharded model: give each rank "
                             "its own checkpoint path (e.g. f'ckpt.rank{rank}.pt') and load each "
                             "rank's file on the same rank, with the same sharding")

    def bind(self, named: list) -> None:
        """The sharded trainable parameters, in the optimizer's order, and their layouts."""
        self._named = named
        self._layouts = [_Layout(name, p, self.world, self.rank) for name, p in named]
        self._structure = hashlib.sha256(repr([
            (name, tuple(p.shape), str(p.dtype), repr(p.placements)) for name, p in named])
            .encode()).hexdigest()

    def reduce_scatter(self, sums: dict, counts: torch.Tensor, device
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """This rank's coordinates of the sum over ranks of each clipped sum (float32, padded to
        the parameter's largest chunk), and the sum over ranks of ``counts`` (this rank's
        example count last; every rank receives the totals). A block's sums were
        reduce-scattered in the backward (``early``); the rest go in one collective."""
        late = [layout for layout in self._layouts if layout.name not in self.early]
        row = sum(layout.padded for layout in late) + counts.numel()
        rows = torch.zeros(self.world, row, dtype=torch.float32, device=device)
        offset = 0
        for layout in late:
            full = sums.get(layout.name)
            if full is not None:
                layout.lay_out(full, rows[:, offset:offset + layout.padded])
            offset += layout.padded
        rows[:, row - counts.numel():] = counts.to(device=device, dtype=torch.float32)
        mine = torch.empty(row, dtype=torch.float32, device=device)
        _reduce_scatter(mine, rows.reshape(-1), op=dist.ReduceOp.SUM, group=self.group)
        out, offset = {}, 0
        for layout in late:
            out[layout.name] = mine[offset:offset + layout.padded]
            offset += layout.padded
        out.update(self.early)
        return out, mine[row - counts.numel():]

    def write_grads(self, mine: dict[str, torch.Tensor], ledger) -> None:
        """Each sharded parameter's gradient: this rank's coordinates, as a DTensor with the
        parameter's placement."""
        from torch.distributed.tensor import DTensor

        for layout, (name, p) in zip(self._layouts, self._named):
            local = mine[name][:layout.local_numel].view(layout.local_shape)
            p.grad = DTensor.from_local(local.to(p.dtype).clone(), p.device_mesh, p.placements,
                                        shape=p.shape, stride=p.stride())
            ledger.released(name, p)
        self.early.clear()

    def reset(self) -> None:
        self.early.clear()

    @property
    def names(self) -> list[str]:
        """The sharded trainable parameters, in the optimizer's order."""
        return [layout.name for layout in self._layouts]

    # -- blocks ------------------------------------------------------------------------------------
    def place_blocks(self, model: torch.nn.Module, blocks: list) -> dict[int, "Place"]:
        """A ``Place`` for each block (name, module) that is an FSDP unit (Note [Sharded
        blocks]): id(block) -> its place. Every unit must be gathered."""
        units = {id(u): (u, state) for u, state in zip(self.units, self._states)}
        for name, block in blocks:
            if id(block) in units:
                unit, state = units[id(block)]
                self.places[id(unit)] = Place(self, unit, state, name)
        return {uid: place for uid, place in self.places.items()}

    def seed(self, seed: int) -> int:
        """A fixed seed mixed with the rank: no two shards draw the same noise stream."""
        digest = hashlib.sha256(f"dpfx-shard-noise:{seed}:{self.rank}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 2


# torch 2.13 renamed reduce_scatter_tensor, which warns
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Layout:
    """Where one sharded parameter's coordinates go: its chunk per rank (FSDP's ``Shard(dim)``:
    ``torch.chunk`` along dim, empty chunks at the end), padded to its largest chunk."""

    def __init__(self, name: str, p, world: int, rank: int):
        from torch.distributed.tensor import Shard

        (placement,) = p.placements
        if not isinstance(placement, Shard):
            raise ValueError(f"parameter '{name}' is placed {placement}, not sharded; dpfx "
                             f"expects fully_shard's Shard placement")
        self.name, self.dim, self.world = name, placement.dim, world
        self.shape = tuple(p.shape)
        local = p.to_local()
        self.local_shape, self.local_numel = tuple(local.shape), local.numel()
        rest = 1
        for i, size in enumerate(self.shape):
            if i != self.dim:
                rest *= size
        size = self.shape[self.dim] if self.shape else 1
        self.padded = -(-size // world) * rest
        mine = self.chunks(torch.empty(self.shape, device="meta"))
        expected = tuple(mine[rank].shape) if rank < len(mine) else None
        if expected != self.local_shape and not (expected is None and self.local_numel == 0):
            raise ValueError(f"parameter '{name}': this rank's shard has shape "
                             f"{self.local_shape}, dpfx's layout expects {expected}; this FSDP "
                             f"version shards differently from torch.chunk along dim {self.dim}")

    def lay_out(self, full: torch.Tensor, rows: torch.Tensor) -> None:
        """``full``'s chunk for rank r into row r of ``rows`` (world, padded)."""
        for r, chunk in enumerate(self.chunks(full)):
            rows[r, :chunk.numel()] = chunk.reshape(-1)

    def chunks(self, full: torch.Tensor) -> list[torch.Tensor]:
        if tuple(full.shape) != self.shape:
            raise ValueError(f"the clipped sum of '{self.name}' has shape {tuple(full.shape)}, "
                             f"the parameter {self.shape}")
        return list(torch.chunk(full.to(torch.float32), self.world, dim=self.dim))[:self.world]


class Place:
    """A block that is an FSDP unit: its parameters gathered only while its ops run, its clipped
    sums reduce-scattered as soon as they are formed (Note [Sharded blocks])."""

    def __init__(self, sharding: Sharding, unit, state, name: str):
        self.sharding, self.unit, self.name = sharding, unit, name
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        self.groups = groups
        self.params = [fp for g in groups for fp in g.fsdp_params]
        for fp in self.params:
            if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather") or \
                    len(fp.all_gather_outputs) != 1 or fp.all_gather_outputs[0].numel() != \
                    fp._sharded_param_data.numel() * sharding.world:
                raise ValueError(
                    f"FSDP unit '{name}': parameter '{fp._module_info.param_name}' is gathered "
                    f"by an FSDP extension (a tensor subclass with fsdp_pre_all_gather) or "
                    f"laid out otherwise than FSDP's padded dim-0 shards; compile without "
                    f"blocks=")
        # the unit's trainable parameters, in the order of the block's op (its named_parameters)
        by_object = {id(fp._unsharded_param): fp for fp in self.params}
        self.trainable = []
        for pname, p in unit.named_parameters():
            if p.requires_grad:
                fp = by_object.get(id(p))
                if fp is None:
                    raise ValueError(f"FSDP unit '{name}': parameter '{pname}' is not one of "
                                     f"the unit's own; compile without blocks=")
                full = f"{name}.{pname}" if name else pname
                self.trainable.append(
                    (full, _Layout(full, fp.sharded_param, sharding.world, sharding.rank)))
        self.padded = sum(layout.padded for _, layout in self.trainable)

    def attach(self) -> None:
        """The unit's unsharded parameters on its modules, their storage empty."""
        for fp in self.params:
            fp.free_unsharded_param()
        for g in self.groups:
            g._to_unsharded()

    @property
    def filled(self) -> bool:
        return all(fp.all_gather_outputs[0].untyped_storage().size() != 0 for fp in self.params)

    @contextlib.contextmanager
    def resident(self):
        """The unit's parameters gathered for the call (unless they are there) and freed after
        it, with one all-gather per dtype of the unit, as FSDP gathers a unit."""
        if self.filled or not self.params:
            yield
            return
        by_dtype: dict[torch.dtype, list] = {}
        for fp in self.params:
            by_dtype.setdefault(fp._sharded_param_data.dtype, []).append(fp)
        for fps in by_dtype.values():
            self._gather(fps)
        try:
            yield
        finally:
            for fp in self.params:
                fp.free_unsharded_param()

    def _gather(self, fps: list) -> None:
        """``fps``' padded shards (one dtype, S elements end to end on every rank) in one
        collective: rank r's S land at [r*S, (r+1)*S) of the receive buffer, so each parameter's
        columns of its (world, S) view are that parameter's all-gather output, world rows of its
        shard."""
        world = self.sharding.world
        sizes = [fp._sharded_param_data.numel() for fp in fps]
        with torch.no_grad():
            send = torch.cat([fp._sharded_param_data for fp in fps])
            received = send.new_empty(world * send.numel())
            _all_gather(received, send, group=self.sharding.group)
            del send
            outs = [fp.all_gather_outputs[0] for fp in fps]
            for out in outs:
                out.untyped_storage().resize_(out.numel() * out.itemsize)
            with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
                torch.split_with_sizes_copy(received.view(world, -1), sizes, dim=1,
                                            out=[out.view(world, -1) for out in outs])

    @contextlib.contextmanager
    def stand_in(self):
        """The unit's parameters hold this rank's shard in every rank's place (no collective):
        values for the self-check (Note [A block whose parameters live elsewhere])."""
        if self.filled or not self.params:
            yield
            return
        for fp in self.params:
            out = fp.all_gather_outputs[0]
            out.untyped_storage().resize_(out.numel() * out.itemsize)
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.view(self.sharding.world, -1).copy_(fp._sharded_param_data.view(1, -1))
        try:
            yield
        finally:
            for fp in self.params:
                fp.free_unsharded_param()

    def clipped(self, sums: list[torch.Tensor]) -> None:
        """This rank's shard of the sum over ranks of the unit's clipped sums, into ``early``."""
        s = self.sharding
        if len(sums) != len(self.trainable):
            raise RuntimeError(f"dpfx: block '{self.name}' formed {len(sums)} clipped sums for "
                               f"{len(self.trainable)} trainable parameters")
        rows = torch.zeros(s.world, self.padded, dtype=torch.float32, device=sums[0].device
                           if sums else None)
        offset = 0
        for (_, layout), full in zip(self.trainable, sums):
            layout.lay_out(full, rows[:, offset:offset + layout.padded])
            offset += layout.padded
        mine = torch.empty(self.padded, dtype=torch.float32, device=rows.device)
        _reduce_scatter(mine, rows.reshape(-1), op=dist.ReduceOp.SUM, group=s.group)
        del rows
        offset = 0
        for name, layout in self.trainable:
            piece = mine[offset:offset + layout.padded]
            if name in s.early:
                s.early[name] += piece
            else:
                s.early[name] = piece.clone()
            offset += layout.padded


def _named_units(model: torch.nn.Module, found: list):
    names = {id(m): n for n, m in model.named_modules()}
    return [(names.get(id(u), "") or "(root)", u) for u in found]


def _state_of(unit, name: str):
    state = unit._get_fsdp_state()
    if len(getattr(state, "_modules", (unit,))) != 1:
        raise ValueError(f"FSDP unit '{name}' groups several modules (fully_shard([a, b])); "
                         f"dpfx needs one module per unit: call fully_shard on each")
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    for group in groups:
        for fsdp_param in group.fsdp_params:
            policy = fsdp_param.mp_policy
            if policy.param_dtype is not None or policy.reduce_dtype is not None:
                raise ValueError(
                    f"FSDP unit '{name}' has a MixedPrecisionPolicy (param_dtype="
                    f"{policy.param_dtype}, reduce_dtype={policy.reduce_dtype}); dpfx reduces the "
                    f"clipped sums itself in float32. Shard without mp_policy and run the forward "
                    f"under torch.autocast for 16-bit compute")
            if fsdp_param.offload_to_cpu:
                raise ValueError(f"FSDP unit '{name}' offloads its parameters to the CPU "
                                 f"(CPUOffloadPolicy); dpfx does not support offloading: shard "
                                 f"without offload_policy")
    return state
