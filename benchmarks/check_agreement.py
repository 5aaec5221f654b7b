"""Check that the private methods of the benchmark compute the same DP-SGD update.

    python benchmarks/check_agreement.py [--models mlp cnn gpt embedding lstm hf_gpt2 hf_llama]
        [--batch 8] [--detail 5] [--opake-patches]

With sigma = 0 and lr = 1, one step of every private method must change the parameters by the
same clipped, averaged gradient as the reference, a batch-of-one loop with plain autograd
(methods.loop_eager: torch.func's vmap cannot map the Hugging Face models' attention, which
branches on tensor values); prints the largest relative difference per (model, method). Not part
of the timed suite (it recompiles every method).
"""
from __future__ import annotations

import argparse
import os
import sys

import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import methods  # noqa: E402
import models  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(models.DEFAULT_MODELS),
                    choices=list(models.MODELS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--methods", nargs="+", default=["loop_eager", "func_eager", "opacus_hooks",
                                                     "opacus_ghost", "func_compile", "opake_eager",
                                                     "opake_compile", "dpfx", "dpfx_materialize"],
                    help="the first that runs is the reference (default: the batch-of-one loop)")
    ap.add_argument("--detail", type=int, default=0,
                    help="also print each method's N parameters furthest from the reference, "
                         "with the reference update's largest entry (a small update's relative "
                         "difference is the float rounding of the whole)")
    ap.add_argument("--opake-patches", action="store_true",
                    help="run Opake's methods under its process-wide model patches, which a "
                         "model with an attention mask needs (Note [Opake in the harness] in "
                         "methods.py): they run after every other method, so that none of "
                         "those, the reference included, runs patched")
    args = ap.parse_args()
    if args.opake_patches:
        methods.OPAKE_PATCHES = True
        args.methods = sorted(args.methods, key=lambda m: m in methods.OPAKE_METHODS)
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    methods.SIGMA, methods.LR = 0.0, 1.0
    for name in args.models:
        ref = None
        for meth in args.methods:
            torch._dynamo.reset()
            model, x, y = models.build(name, args.batch)
            before = {k: p.detach().clone() for k, p in model.named_parameters()}
            try:
                method = methods.make(meth, model, args.batch, x, y)
                method.step(x, y)
            except Exception as e:
                print(f"{name:10s} {meth:16s} fails: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
                continue
            # Opacus trains a converted copy (nn.LSTM -> DPLSTM), whose state_dict keeps the names
            after = (method.model or model).state_dict()
            delta = {k: before[k] - after[k].detach() for k in before}
            if ref is None:
                ref = delta
                continue
            errs = sorted(((((delta[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-12)).item(),
                            k) for k in ref), reverse=True)
            print(f"{name:10s} {meth:16s} max relative difference to the reference: "
                  f"{errs[0][0]:.1e}", flush=True)
            for err, k in errs[:args.detail]:
                print(f"    {err:.1e}  {k}  (the reference's largest entry "
                      f"{ref[k].abs().max().item():.2e})", flush=True)


if __name__ == "__main__":
    main()
