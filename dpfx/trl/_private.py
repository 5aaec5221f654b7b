"""``DPTrainer`` beneath a TRL trainer: what DP SFT and DP DPO share.

    class DPSFTTrainer(PrivateTRL, trl.SFTTrainer, DPTrainerUnderTRL): ...
    # method order: DPSFTTrainer, PrivateTRL, SFTTrainer, trl's _BaseTrainer, DPTrainerUnderTRL,
    # DPTrainer, Trainer

# Note [A TRL trainer over DPTrainer]
A TRL trainer's constructor prepares everything DP needs to know before it calls Trainer's: it
wraps the model in PEFT, applies the chat template, tokenizes the dataset, builds the labels
(completion-only, assistant-only) and the collator. Placed between the TRL trainer and
``Trainer`` in the method order, ``DPTrainer``'s constructor therefore receives the model and the
train set as they will be trained, and plans q, sigma and the steps over the prepared set,
compiles the model and wraps nothing else (DPTrainer's own planning, unchanged). TRL's
constructor then goes on with ``self.model``: it tags it, reads its config and patches a fused
LM head into its forward (a chunked custom autograd.Function over the flattened batch, which
dpfx would not prove per example). For those lines ``self.model`` is the user's model; the
compiled model takes its place when TRL's constructor returns, and the fused head is taken off
the user's model again, so the only path to a gradient is dpfx's graph (as is the hook TRL adds
for PEFT with activation checkpointing, whose ``requires_grad_`` on the embeddings' output
dynamo cannot capture). Each DP trainer computes
its loss from the compiled model's logits (``compute_loss``), never through the fused head.

# Note [Every batch padded to max_length]
TRL's collators pad a batch to its longest row, so the sequence length changes from batch to
batch, and so would dpfx's compiled graph: a new length recompiles the model with the length
symbolic, and an empty Poisson batch after that failed in the compiled graph (torch 2.13,
``RuntimeError: Ne(u0, 0)``). Unless the config sets ``pad_to_multiple_of``, each DP TRL trainer
pads every batch to ``max_length`` instead (TRL's default config has one; a config without one
is refused): one graph per batch-size class, and the same per-example loss, since the padding is
masked out of attention and labelled -100.

The DP options are ``DPTrainer``'s keyword-only arguments (``DP_OPTIONS``), declared there once.
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace

from dpfx.hf import DPTrainer, resume
from dpfx.loop.users import PerUser, per_user

# DPTrainer's own options (max_grad_norm, noise_multiplier, target_epsilon, accountant, ...)
DP_OPTIONS = tuple(name for name, p in inspect.signature(DPTrainer.__init__).parameters.items()
                   if p.kind is inspect.Parameter.KEYWORD_ONLY)


def split_options(kwargs: dict) -> tuple[dict, dict]:
    """(DPTrainer's options, the TRL trainer's arguments) of a DP TRL trainer's keywords."""
    return ({k: v for k, v in kwargs.items() if k in DP_OPTIONS},
            {k: v for k, v in kwargs.items() if k not in DP_OPTIONS})


class PrivateTRL:
    """The DP side of a DP TRL trainer, first in its bases: ``class DPSFTTrainer(PrivateTRL,
    trl.SFTTrainer, DPTrainerUnderTRL)`` (Note [A TRL trainer over DPTrainer]). Its keywords are
    the TRL trainer's and DPTrainer's options; ``check_trl_options`` refuses what the subclass
    cannot train privately before anything is touched."""

    rows_per_example = 1    # the sequences a unit of privacy brings (2 for a preference pair)

    def __init__(self, model=None, args=None, **kwargs):
        options, trl_kwargs = split_options(kwargs)
        self.check_trl_options(model, args or SimpleNamespace(), trl_kwargs)
        self._dp_options = options
        super().__init__(model=model, args=args, **trl_kwargs)
        users = self.model
        self.model = self.model_wrapped = self.callback_handler.model = self.__dict__.pop(
            "_compiled")
        base = users.get_base_model() if hasattr(users, "get_base_model") else users
        fused = getattr(vars(base).get("forward"), "__func__", None)
        if fused is not None and fused.__code__.co_name == "_fused_forward":
            del base.forward        # the class's own forward again
        _drop_input_require_grads(base)
        # See Note [Every batch padded to max_length]
        collator = self.data_collator
        if getattr(collator, "pad_to_multiple_of", 0) is None:
            collator.pad_to_multiple_of = self.args.max_length

    def check_trl_options(self, model, args, trl_kwargs: dict) -> None:
        """Raise where the TRL trainer's options (``args`` an empty namespace where not given)
        cannot train privately."""
        if getattr(args, "max_length", 0) is None:
            raise ValueError(
                f"{type(self).__name__} pads every batch to max_length (Note [Every batch padded "
                f"to max_length] in dpfx/trl/_private.py); set max_length in the config")

    def create_model_card(self, *args, **kwargs):
        """TRL's model card reads the user's model's config."""
        with resume.users_model(self):
            return super().create_model_card(*args, **kwargs)


class DPTrainerUnderTRL(DPTrainer):
    """``DPTrainer``'s constructor where TRL's calls Trainer's: the model and train set as TRL
    prepared them (Note [A TRL trainer over DPTrainer])."""

    def __init__(self, model=None, args=None, **trainer_kwargs):
        options = self.__dict__.pop("_dp_options")
        if self.rows_per_example > 1:       # Note [A pair is one row] in dpo.py
            model = per_user(model)
        DPTrainer.__init__(self, model, args, **options, **trainer_kwargs)
        # the rest of TRL's constructor reads, tags and patches the user's model
        self._compiled = self.model
        users = self._compiled._orig_mod
        users = users.module if isinstance(users, PerUser) else users
        self.model = self.model_wrapped = self.callback_handler.model = users


def _drop_input_require_grads(model) -> None:
    """Removes transformers' ``enable_input_require_grads`` hooks (``requires_grad_`` on the
    input embeddings' output, which TRL and transformers add for PEFT with activation
    checkpointing, each call leaving one): dynamo cannot capture them, and dpfx's graph needs
    none."""
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__qualname__", "").endswith("<locals>.make_inputs_require_grads"):
                del module._forward_hooks[key]
    if "_require_grads_hooks" in vars(model):
        model._require_grads_hooks = []
