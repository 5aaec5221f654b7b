"""Opacus 1.6's ``PrivacyEngine``, over ``dpfx.make_private``.

    from dpfx.opacus import PrivacyEngine          # was: from opacus import PrivacyEngine

    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=train_loader,
        noise_multiplier=1.0, max_grad_norm=1.0)
    for x, y in train_loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    privacy_engine.get_epsilon(delta=1e-5)

The arguments mean what they mean in Opacus and the run is wired as Opacus wires it: the Poisson
sample rate is q = 1 / len(data_loader), an epoch is len(data_loader) steps, the mean loss is
divided by the expected batch size q N. What comes back is dpfx's: ``model`` is the
``dpfx.compile``d module (it shares the parameters; the plain loop above is dpfx's plain loop),
``optimizer`` a ``dpfx.DPOptimizer`` and ``data_loader`` dpfx's Poisson loader, which keeps the
given loader's workers, pinning and collate_fn.

# Note [Which accountant answers to which name]
dp-accounting's PLD and RDP accountants are what dpfx has (``dpfx.privacy``).
* "prv" (Opacus's default): PLD. Both are numerically tight accountants of the Poisson-subsampled
  Gaussian; on the runs of benchmarks/opacus_switch.py the two epsilons agree within 2%
  (PLD is the lower by 0.1-1.1%).
* "rdp": RDP, the same analysis Opacus runs (agrees to 0.1%).
* "gdp": PLD. Opacus's GaussianAccountant is the central-limit approximation of Dong et al.
  (2019), which is not an upper bound: over a few steps it reports half the epsilon PLD proves
  (1.25 against 2.60 for sigma 1, q 1/8, 4 steps). dpfx reports the bound, and says so once.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpfx import engine, privacy
from dpfx.privacy import plan as privacy_plan
from dpfx.privacy import validate
from dpfx.api import DPModule
from dpfx.errors import DPFXWarning, OptionError, OptionValueError
from dpfx.loop.optim import DPOptimizer
from dpfx.opacus.validators.module_validator import ModuleValidator

ACCOUNTANTS = {"prv": "pld", "rdp": "rdp", "gdp": "pld"}
GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "ghost", "ghost_fsdp")
CLIPPING_MODES = ("flat", "per_layer")


class OpacusAccountant(privacy.Accountant):
    """A ``dpfx.privacy.Accountant`` that also answers Opacus's ``IAccountant`` calls:
    ``mechanism()``, ``len()`` and ``history`` as a list of (sigma, q, steps)."""

    def __init__(self, mechanism: str):
        super().__init__(ACCOUNTANTS[mechanism])
        self._mechanism = mechanism

    def mechanism(self) -> str:
        return self._mechanism

    def __len__(self) -> int:
        return len(self._history)

    def get_epsilon(self, delta: float, **kwargs) -> float:
        if kwargs:
            raise TypeError(f"get_epsilon takes only delta in dpfx (the {self.accountant} "
                            f"accountant has no {sorted(kwargs)}), got {sorted(kwargs)}")
        return super().get_epsilon(delta)


class PrivacyEngine:
    """Opacus's ``PrivacyEngine(accountant=, secure_mode=)``; the accountant per Note [Which
    accountant answers to which name]. ``secure_mode=True`` needs no torchcsprng: dpfx draws the
    noise and the Poisson batches from the OS's CSPRNG (docs/accounting.md)."""

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False):
        if accountant not in ACCOUNTANTS:
            raise OptionValueError(f"accountant must be one of {sorted(ACCOUNTANTS)}, got "
                                   f"{accountant!r} (dpfx accounts 'prv' and 'gdp' with PLD, 'rdp' "
                                   f"with RDP)")
        if not isinstance(secure_mode, bool):
            raise OptionError(f"secure_mode must be a bool, got {secure_mode!r}")
        if accountant == "gdp":
            warnings.warn("accountant='gdp': dpfx reports the PLD epsilon, an upper bound; "
                          "Opacus's GDP accountant is a central-limit approximation that can "
                          "report less (Note [Which accountant answers to which name] in "
                          "dpfx/opacus/privacy_engine.py)", DPFXWarning, stacklevel=2)
        self.accountant = OpacusAccountant(accountant)
        self.secure_mode = secure_mode
        self.dataset = None

    # -- validation, as Opacus offers it ---------------------------------------------------------
    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        module = ModuleValidator.fix(module)
        ModuleValidator.validate(module, strict=True)
        return module

    def is_compatible(self, *, module: nn.Module, optimizer=None, data_loader=None) -> bool:
        return ModuleValidator.is_valid(module)

    def validate(self, *, module: nn.Module, optimizer=None, data_loader=None) -> None:
        ModuleValidator.validate(module, strict=True)

    # -- make_private ----------------------------------------------------------------------------
    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                     data_loader: DataLoader, noise_multiplier: float,
                     max_grad_norm: float | list[float], criterion=None,
                     batch_first: bool = True, loss_reduction: str = "mean",
                     poisson_sampling: bool = True, clipping: str = "flat",
                     noise_generator: torch.Generator | None = None,
                     grad_sample_mode: str = "hooks", wrap_model: bool = True,
                     rand_on_empty: bool = False, **kwargs):
        """Returns (model, optimizer, data_loader), or (model, optimizer, criterion,
        data_loader) when ``grad_sample_mode`` is "ghost" or "ghost_fsdp", as Opacus does.

        ``grad_sample_mode`` is accepted and checked, but it chooses nothing: dpfx picks the
        per-sample form of every layer itself (materialized, ghost norm or book-keeping,
        ``dpfx.compile(strategy="auto")``), with the same gradients in every case. In ghost
        mode the criterion comes back as given: dpfx needs no second backward pass, so
        ``criterion(model(x), y).backward()`` is the whole step.

        ``clipping``: "flat", or "per_layer" with ``max_grad_norm`` a list of bounds paired
        with the optimizer's trainable parameters in order (as Opacus pairs them): each
        parameter is clipped to its own bound and the noise std is sigma * sqrt(sum C^2).
        ``poisson_sampling=False`` keeps ``data_loader`` as it is (Opacus's approximation; the
        accountant still assumes Poisson sampling at q = 1 / len(data_loader)).
        ``noise_generator``: the noise is seeded from it (reproducible, and
        ``dpfx.FixedSeedWarning`` says so).
        """
        criterion = nn.CrossEntropyLoss() if criterion is None else criterion
        dp_kwargs = self._check(module, optimizer, data_loader, max_grad_norm, batch_first,
                                poisson_sampling, clipping, noise_generator, grad_sample_mode,
                                wrap_model, rand_on_empty, kwargs)
        private = engine.make_private(
            module, optimizer, data_loader, noise_multiplier=noise_multiplier,
            sample_rate=1 / len(data_loader), accountant=self.accountant,
            secure_mode=self.secure_mode, loss_reduction=loss_reduction, noise="optimizer",
            **dp_kwargs)
        loader = private.loader if poisson_sampling else data_loader
        if grad_sample_mode in ("ghost", "ghost_fsdp"):
            return private.model, private.optimizer, criterion, loader
        return private.model, private.optimizer, loader

    def make_private_with_epsilon(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  data_loader: DataLoader, target_epsilon: float,
                                  target_delta: float, epochs: int,
                                  max_grad_norm: float | list[float], **kwargs):
        """``make_private`` with sigma calibrated so that ``epochs`` passes of
        len(data_loader) steps spend ``target_epsilon`` at ``target_delta``, by this engine's
        accountant (``dpfx.privacy.noise_multiplier``; Opacus's bisection stops within 0.01
        below the target, dpfx's search within 0.1% of the smallest sigma that reaches it)."""
        if len(self.accountant) > 0:
            warnings.warn("make_private_with_epsilon on an engine that has already counted "
                          "steps: sigma is calibrated for a fresh budget, so the run's total "
                          "epsilon will exceed target_epsilon", DPFXWarning, stacklevel=2)
        if not isinstance(data_loader, DataLoader):
            raise OptionError(f"data_loader must be a torch DataLoader, got "
                              f"{type(data_loader).__name__}")
        validate.integer(epochs, "epochs", 1)
        sigma = privacy_plan.make(
            sample_rate=1 / len(data_loader),
            target_epsilon=target_epsilon, target_delta=target_delta,
            steps=epochs * len(data_loader), accountant=self.accountant.accountant,
            steps_name="epochs").noise_multiplier
        return self.make_private(module=module, optimizer=optimizer, data_loader=data_loader,
                                 noise_multiplier=sigma, max_grad_norm=max_grad_norm, **kwargs)

    def get_epsilon(self, delta: float) -> float:
        return self.accountant.get_epsilon(delta)

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, *, path, module: nn.Module, optimizer: DPOptimizer | None = None,
                        noise_scheduler=None, grad_clip_scheduler=None,
                        checkpoint_dict: dict[str, Any] | None = None,
                        module_state_dict_kwargs=None, torch_save_kwargs=None) -> None:
        """``dpfx.save_checkpoint``: the model, the optimizer's state and the accountant's
        ledger in one atomically replaced file; ``checkpoint_dict``'s entries ride along and
        come back from ``load_checkpoint``. ``path`` is a file path (a file object is
        refused: the write is atomic by renaming)."""
        self._check_checkpoint_args(path, optimizer, noise_scheduler, grad_clip_scheduler,
                                    module_state_dict_kwargs, torch_save_kwargs)
        engine.save_checkpoint(path, model=module, optimizer=optimizer,
                               **(checkpoint_dict or {}))

    def load_checkpoint(self, *, path, module: nn.Module, optimizer: DPOptimizer | None = None,
                        noise_scheduler=None, grad_clip_scheduler=None,
                        module_load_dict_kwargs=None, torch_load_kwargs=None) -> dict:
        """``dpfx.load_checkpoint`` into this engine's run; returns the saved
        ``checkpoint_dict``. The accountant keeps counting from the checkpoint's steps."""
        self._check_checkpoint_args(path, optimizer, noise_scheduler, grad_clip_scheduler,
                                    module_load_dict_kwargs, torch_load_kwargs)
        if optimizer.accountant is not self.accountant:
            raise ValueError("optimizer was not made by this PrivacyEngine: its accountant is "
                             "not this engine's, so the loaded steps would not count here")
        return engine.load_checkpoint(path, model=module, optimizer=optimizer)

    # -- checks: everything is refused before anything is built ---------------------------------
    def _check(self, module, optimizer, data_loader, max_grad_norm, batch_first,
               poisson_sampling, clipping, noise_generator, grad_sample_mode, wrap_model,
               rand_on_empty, kwargs) -> dict:
        dpfx_own = {"strategy", "backend", "track_norms", "ledger", "loss", "process_group"}
        unknown = sorted(set(kwargs) - dpfx_own)
        if unknown:
            raise OptionError(f"make_private got {unknown}, which dpfx.opacus does not take. It "
                              f"takes Opacus 1.6's arguments and dpfx.make_private's "
                              f"{sorted(dpfx_own)}")
        if isinstance(module, DPModule):
            raise OptionValueError("module is already a dpfx-compiled model: pass the nn.Module")
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise OptionValueError("dpfx takes the bare module under torch.distributed (it "
                                   "all-reduces the clipped sums itself): pass module.module")
        if not isinstance(data_loader, DataLoader):
            raise OptionError(f"data_loader must be a torch DataLoader, got "
                              f"{type(data_loader).__name__}")
        ModuleValidator.validate(module, strict=True)
        own = set(module.parameters())
        if any(p not in own for group in optimizer.param_groups for p in group["params"]):
            raise OptionValueError("Module parameters are different than optimizer Parameters: "
                                   "build the optimizer over module.parameters()")
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise OptionValueError(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES} (dpfx "
                                   f"picks the per-sample form per layer in all of them), got "
                                   f"{grad_sample_mode!r}")
        if clipping == "adaptive":
            raise OptionValueError("clipping='adaptive' is not offered through the Opacus surface, "
                                   "which clips 'flat' or 'per_layer' (Opacus's min/max clipbound "
                                   "and unclipped_num_std have no dpfx counterpart): use "
                                   "dpfx.make_private(..., clipping='adaptive', "
                                   "target_unclipped_quantile=, clip_lr=, "
                                   "count_noise_multiplier=)")
        if clipping not in CLIPPING_MODES:
            raise OptionValueError(f"clipping={clipping!r} is not offered by dpfx: it clips 'flat' "
                                   f"(one bound) or 'per_layer' (a bound per parameter, or "
                                   f"dpfx.make_private(max_grad_norm={{name prefix: C}}) for "
                                   f"groups)")
        if clipping == "per_layer" and grad_sample_mode in ("ghost", "ghost_fsdp"):
            raise OptionValueError(f"clipping='per_layer' with "
                                   f"grad_sample_mode={grad_sample_mode!r} is refused by Opacus "
                                   f"too; dpfx picks the per-sample form itself, so use "
                                   f"grad_sample_mode='hooks'")
        if not batch_first:
            raise OptionValueError("batch_first=False: dpfx takes dim 0 of every input as the "
                                   "batch dim; transpose inputs inside the model's forward instead")
        if wrap_model is not True:
            raise OptionValueError("wrap_model=False: dpfx trains through the module it returns "
                                   "(dpfx.compile); the original module's own gradients would not "
                                   "be private, so use the returned model")
        if rand_on_empty:
            raise OptionValueError("rand_on_empty=True: dpfx runs empty Poisson batches (batch "
                                   "size 0) through the same graph, so no random stand-in is "
                                   "needed; drop the argument")
        if not isinstance(poisson_sampling, bool):
            raise OptionError(f"poisson_sampling must be a bool, got {poisson_sampling!r}")
        if self.secure_mode and not poisson_sampling:
            raise OptionValueError("secure_mode with poisson_sampling=False: dpfx's secure "
                                   "sampling is Poisson sampling from the OS's CSPRNG; use "
                                   "poisson_sampling=True")
        if noise_generator is not None and self.secure_mode:
            raise OptionValueError("Passing seed is prohibited in secure mode: noise_generator "
                                   "would make the noise replayable")
        if noise_generator is not None and not isinstance(noise_generator, torch.Generator):
            raise OptionError(f"noise_generator must be a torch.Generator, got "
                              f"{type(noise_generator).__name__}")
        if self.dataset is not None and self.dataset is not data_loader.dataset:
            warnings.warn("PrivacyEngine detected a new dataset object: its accountant counts "
                          "one dataset; make a new PrivacyEngine for another", DPFXWarning,
                          stacklevel=3)
        self.dataset = data_loader.dataset

        dp_kwargs = dict(kwargs)
        dp_kwargs["max_grad_norm"] = _bounds(module, optimizer, max_grad_norm, clipping)
        if noise_generator is not None:
            dp_kwargs["seed"] = int(torch.randint(2**62, (), generator=noise_generator))
        return dp_kwargs

    def _check_checkpoint_args(self, path, optimizer, noise_scheduler, grad_clip_scheduler,
                               state_kwargs, torch_kwargs) -> None:
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError("optimizer= must be the DPOptimizer make_private returned: dpfx "
                            "keeps the accountant's ledger in its state")
        if noise_scheduler is not None or grad_clip_scheduler is not None:
            raise ValueError("dpfx has no noise or clipping schedulers: sigma and C are fixed "
                             "with the compiled model (make a new run for new values)")
        if state_kwargs or torch_kwargs:
            raise ValueError("dpfx writes its own checkpoint format (atomic, checksummed: "
                             "dpfx.save_checkpoint); state_dict and torch.save/load keyword "
                             "arguments do not apply")
        if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
            raise TypeError(f"path must be a file path: dpfx replaces the checkpoint file "
                            f"atomically by renaming, got {type(path).__name__}")


def _bounds(module: nn.Module, optimizer, max_grad_norm, clipping: str):
    """Opacus's bound (flat) or list of bounds (per layer, one per trainable parameter of the
    optimizer, in order) as dpfx's: a number, or a dict from parameter name to bound."""
    if clipping == "flat":
        if isinstance(max_grad_norm, (list, tuple)):
            raise OptionValueError("clipping='flat' takes one max_grad_norm; a list of bounds is "
                                   "clipping='per_layer'")
        return max_grad_norm
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if not isinstance(max_grad_norm, (list, tuple)) or len(max_grad_norm) != len(params):
        raise OptionValueError(f"clipping='per_layer' needs max_grad_norm as a list of "
                               f"{len(params)} bounds, one per trainable parameter of the "
                               f"optimizer in order, got {max_grad_norm!r}")
    names = {p: n for n, p in module.named_parameters()}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    bounds = {names[p]: c for p, c in zip(params, max_grad_norm)}
    missing = sorted(trainable - set(bounds))
    if missing:
        raise OptionValueError(f"clipping='per_layer': the trainable parameters {missing} are not "
                               f"in the optimizer, so no bound is paired with them; freeze them "
                               f"(requires_grad=False) or give them to the optimizer")
    return bounds
