"""``DPAdamBC``: Adam(W) whose second moment has the privatization noise's variance taken out.

    dp_model = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.1,
                            expected_batch_size=256, noise="optimizer")
    opt = dpfx.DPOptimizer(dpfx.DPAdamBC(model.parameters(), lr=1e-4, gamma=1e-8), dp_model,
                           accountant=dpfx.privacy.Accountant(), sample_rate=256 / 60000)
    ...
    opt.step()      # DPOptimizer sets the inner optimizer's dp_noise_variance, then it steps

DP-SGD's released gradient is g~ = g + n, with n of per-coordinate variance
Phi = (sigma * S / D)^2 (S the clipping sensitivity, D the divisor) for Gaussian noise, and
sigma^2 S^2 / D^2 times the strategy's Var(w_t) for correlated noise (it changes per step). Adam's
second moment then estimates E[g^2] + Phi: where the noise dominates, every coordinate is divided
by about sqrt(Phi), and DP-Adam is DP-SGD with the step lr / sqrt(Phi) (Tang, Panda, Sinha,
Mittal & Lin, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply Bias Correction)",
AAAI 2024). DP-AdamBC subtracts Phi:

    m_t = beta1 m_{t-1} + (1 - beta1) g~_t           m_hat = m_t / (1 - beta1^t)
    v_t = beta2 v_{t-1} + (1 - beta2) g~_t^2         v_hat = v_t / (1 - beta2^t)
    theta_t = theta_{t-1} - lr * m_hat / (sqrt(max(v_hat - Phi_bar_t, gamma)) + eps)

with Phi_bar_t = Phi for Gaussian noise (Note [Where the floor and Phi go]). ``weight_decay``
adds ``weight_decay * theta`` to g~ (torch.optim.Adam), or with ``decoupled_weight_decay=True``
multiplies theta by ``1 - lr * weight_decay`` before the update (torch.optim.AdamW).

The optimizer cannot know Phi: ``dp_noise_variance`` (None until set) is the per-coordinate
variance of the noise in the p.grad of the coming step. ``dpfx.DPOptimizer`` sets it before each
inner step; who adds the noise by hand sets it (``DPAdamBC.gaussian_noise_variance`` gives
DP-SGD's). A step while it is None is refused: Adam with an unknown Phi would be DP-Adam, not
what was asked for.

# Note [Where the floor and Phi go]
Algorithm 1 of Tang et al. (2024) updates with m_hat / sqrt(max(v_hat - Phi, gamma')): the floor
gamma' (``gamma``) is on the corrected variance, inside the square root, and there is no Adam eps
(the authors' code, ubc-systopia/DP-AdamBC, computes the same, its eps unused). ``eps`` defaults
to 0 so; it is added after the root as torch.optim.Adam adds it, so that with Phi = 0 and a
``gamma`` below every v_hat the step is torch.optim.Adam(W)'s with the same eps, operation for
operation (tests/loop/test_adambc.py). Phi is subtracted from the bias-corrected v_hat, whose
noise part has expectation exactly Phi at every t ((1 - beta2) sum_i beta2^(t-i) = 1 - beta2^t):
a constant Phi takes no (1 - beta2^t) factor. When Phi_t changes per step (correlated noise, an
adaptive bound), v_hat's noise part is the same weighted mean of the Phi_i, so that mean is what
is subtracted: ``noise_variance_sum`` = beta2 s + (1 - beta2) Phi_t is kept beside v_t (one float
per parameter, in float64) and the step uses max(v_t - s_t, gamma (1 - beta2^t)) / (1 - beta2^t),
which is max(v_hat - Phi_bar, gamma); for a constant Phi, s_t = Phi (1 - beta2^t) and this is the
paper's update. (Correlated noise makes g_t depend on earlier noise that n_t is correlated with,
so E[g~_t^2] - E[g_t^2] - Phi_t = 2 E[g_t n_t] need not vanish; the correction neglects it.)
Where the noise dominates, v_hat - Phi_bar is about 0 and the step is about lr m_hat / sqrt(gamma):
``gamma`` (default 1e-8, the order of the authors' published settings, 1e-9 to 7e-9) is tuned
with lr, relative to Phi. Opake's AdamW-BC (Chooi et al. 2025, "DP-AdamW") keeps the same mean of
Phi but uses the uncorrected v_hat where v_hat - Phi_bar <= 0, which bounds those steps by
Adam's; the two agree elsewhere (tests/loop/test_adambc.py pins Opake 0.16.1's numbers).

# Note [No AMSGrad]
AMSGrad divides by the running maximum of v_hat. With the noise's variance subtracted, that
maximum would keep the largest noise draw of the whole run (v_hat - Phi fluctuates around E[g^2]
by O(Phi) on coordinates the noise dominates), undoing the correction for good; Tang et al.
define no AMSGrad variant. ``amsgrad=True`` is refused.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch


class DPAdamBC(torch.optim.Optimizer):
    """Bias-corrected DP-Adam(W); set ``dp_noise_variance`` (or let DPOptimizer) before a step."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 gamma: float = 1e-8, eps: float = 0.0, weight_decay: float = 0.0,
                 decoupled_weight_decay: bool = False, amsgrad: bool = False):
        defaults = dict(lr=lr, betas=betas, gamma=gamma, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, amsgrad=amsgrad)
        _check_group(defaults)
        self.dp_noise_variance: float | None = None
        super().__init__(params, defaults)

    def __getstate__(self) -> dict:     # pickle and deepcopy keep Phi with the moments
        return {**super().__getstate__(), "dp_noise_variance": self.dp_noise_variance}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__({"dp_noise_variance": None, **state})

    def add_param_group(self, param_group: dict) -> None:
        _check_group({**getattr(self, "defaults", {}), **param_group})
        super().add_param_group(param_group)

    @staticmethod
    def gaussian_noise_variance(noise_multiplier: float,
                                max_grad_norm: float | Mapping[str, float],
                                divisor: float) -> float:
        """Phi of DP-SGD with Gaussian noise: (sigma * S / D)^2, S = C, or sqrt(sum_g C_g^2) for
        per-layer bounds (a mapping), D the divisor of the noisy sum (the expected batch size
        for loss_reduction="mean", 1 for "sum")."""
        bounds = list(max_grad_norm.values()) if isinstance(max_grad_norm, Mapping) \
            else [max_grad_norm]
        values = [float(noise_multiplier), float(divisor)] + [float(c) for c in bounds]
        if not all(math.isfinite(v) and v >= 0 for v in values) or float(divisor) == 0:
            raise ValueError(f"gaussian_noise_variance: noise_multiplier ({noise_multiplier}) "
                             f"and max_grad_norm ({max_grad_norm}) must be finite and >= 0, "
                             f"divisor ({divisor}) finite and > 0")
        sensitivity = math.sqrt(sum(float(c) ** 2 for c in bounds))
        return (float(noise_multiplier) * sensitivity / float(divisor)) ** 2

    def _noise_variance(self) -> float:
        phi = self.dp_noise_variance
        if phi is None:
            raise RuntimeError(
                "DPAdamBC.step(): dp_noise_variance is None. The bias correction subtracts the "
                "per-coordinate variance of the privatization noise in p.grad, which the "
                "optimizer cannot know: wrap it in dpfx.DPOptimizer (it sets dp_noise_variance "
                "before each step), or set optimizer.dp_noise_variance yourself, e.g. "
                "DPAdamBC.gaussian_noise_variance(noise_multiplier, max_grad_norm, divisor) "
                "for DP-SGD (0.0 for gradients without noise)")
        if isinstance(phi, torch.Tensor):
            phi = phi.item() if phi.numel() == 1 else phi
        if isinstance(phi, bool) or not isinstance(phi, (int, float)) or \
                not math.isfinite(phi) or phi < 0:
            raise ValueError(f"DPAdamBC: dp_noise_variance must be a finite float >= 0 (the "
                             f"noise's per-coordinate variance in p.grad), got {phi!r}")
        return float(phi)

    @torch.no_grad()
    def step(self, closure=None):
        phi = self._noise_variance()        # refused before anything changes
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for group in self.param_groups:
            _check_group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("DPAdamBC supports dense real parameters and gradients "
                                       f"only, got a {'sparse' if p.grad.is_sparse else 'complex'}"
                                       f" one of shape {tuple(p.shape)}")
                work.append((group, p))
        for group, p in work:
            _adambc_step(p, self.state[p], group, phi)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        for key, s in state_dict.get("state", {}).items():
            if "exp_avg_sq" in s and "noise_variance_sum" not in s:
                raise ValueError(
                    f"the state of parameter {key} has Adam's moments but no "
                    f"noise_variance_sum: it comes from another optimizer, whose second moment "
                    f"holds noise variance DPAdamBC would not subtract. Start DPAdamBC's state "
                    f"fresh, or load a DPAdamBC.state_dict()")
        super().load_state_dict(state_dict)


def _check_group(group: dict) -> None:
    if group.get("amsgrad"):
        raise ValueError("DPAdamBC: amsgrad=True is not supported. AMSGrad's running maximum of "
                         "the second moment would keep the largest noise draw and undo the bias "
                         "correction (Note [No AMSGrad] in dpfx/loop/adambc.py); use "
                         "amsgrad=False")
    beta1, beta2 = group["betas"]
    checks = [("lr", float(group["lr"]) >= 0), ("betas[0]", 0 <= beta1 < 1),
              ("betas[1]", 0 <= beta2 < 1), ("gamma", float(group["gamma"]) > 0),
              ("eps", float(group["eps"]) >= 0), ("weight_decay", group["weight_decay"] >= 0)]
    wrong = [name for name, ok in checks if not ok]
    if wrong:
        raise ValueError(f"DPAdamBC: invalid {', '.join(wrong)} (lr, eps and weight_decay must be "
                         f">= 0, betas in [0, 1), gamma > 0: the floor of the corrected second "
                         f"moment), got lr={group['lr']}, betas={group['betas']}, "
                         f"gamma={group['gamma']}, eps={group['eps']}, "
                         f"weight_decay={group['weight_decay']}")


def _adambc_step(p: torch.Tensor, state: dict, group: dict, phi: float) -> None:
    """One parameter's update. The operations and their order are torch.optim.Adam's
    single-tensor step, with v_t - s_t floored in place of v_t (Note [Where the floor and Phi
    go])."""
    beta1, beta2 = group["betas"]
    lr, weight_decay = float(group["lr"]), group["weight_decay"]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["noise_variance_sum"] = 0.0
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    state["step"] += 1
    step = state["step"].item()
    grad = p.grad
    if weight_decay != 0:
        if group["decoupled_weight_decay"]:
            p.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(p, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    noise_sum = beta2 * state["noise_variance_sum"] + (1 - beta2) * phi
    state["noise_variance_sum"] = noise_sum
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    floor = group["gamma"] * bias_correction2
    if noise_sum:
        denom = exp_avg_sq.sub(noise_sum).clamp_(min=floor)
    else:
        denom = exp_avg_sq.clamp(min=floor)
    denom.sqrt_().div_(bias_correction2 ** 0.5).add_(group["eps"])
    p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
