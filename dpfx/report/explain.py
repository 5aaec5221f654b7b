"""``dpfx.explain``: what the compiler did to each parameter, and every graph it produced.

    report = dpfx.explain(model, x, max_grad_norm=1.0, noise_multiplier=1.0)
    print(report)                 # parameter | shape | rule | strategy | per-sample form | cost
    report.write("dumps/")        # forward.txt, backward.captured.txt, backward.private.txt + .png

explain compiles with backend="eager" (the same rewritten graphs as Inductor gets, without the C++
compile), runs one forward on copies of the inputs, and never touches ``p.grad``. "stacked" in the
strategy column: the parameter's per-sample gradient shares one norm and one clipped sum with the
other vector parameters of its clipping group (Note [Vector parameters' per-sample gradients
stacked] in passes/clip_noise.py).
"""
from __future__ import annotations

import dataclasses
import os

import sympy
import torch

from dpfx.api import compile as dp_compile


@dataclasses.dataclass
class ParamRow:
    name: str
    shape: tuple
    rules: list[str]
    strategy: str
    form: str
    flops: str
    memory: str


@dataclasses.dataclass
class Report:
    rows: list[ParamRow]
    graphs: dict[str, str]

    def __str__(self) -> str:
        head = ("parameter", "shape", "rule", "strategy", "per-sample form", "flops", "memory")
        body = [(r.name, "x".join(map(str, r.shape)), "+".join(r.rules), r.strategy, r.form,
                 r.flops, r.memory) for r in self.rows]
        widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in body]
        return "\n".join(lines)

    def write(self, directory: str, picture: bool = True) -> list[str]:
        """Write each graph as text (and as PNG when ``picture``); returns the paths."""
        os.makedirs(directory, exist_ok=True)
        paths = []
        for stage, text in self.graphs.items():
            path = os.path.join(directory, f"{stage}.txt")
            with open(path, "w") as f:
                f.write(text)
            paths.append(path)
            if picture:
                paths.append(draw(text, os.path.join(directory, f"{stage}.png")))
        with open(os.path.join(directory, "report.txt"), "w") as f:
            f.write(str(self) + "\n")
        return paths


def explain(model: torch.nn.Module, *example_inputs, **options) -> Report:
    options = {**options, "backend": "eager"}
    dp = dp_compile(model, **options)
    inputs = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with torch.enable_grad():
        dp(*inputs)
    backend = dp._dpfx_backend
    shapes = dict(model.named_parameters())
    rows = []
    for pg in backend.param_grads:
        cost = pg.costs[0] if len(pg.costs) == 1 else _merge(pg.costs)
        key = "ghost_" if pg.strategy == "ghost" else ""
        strategy = pg.strategy + (", stacked" if pg.stacked else "")
        rows.append(ParamRow(pg.name, tuple(shapes[pg.name].shape), pg.rules, strategy,
                             cost[key + "form"], _pretty(cost[key + "flops"]),
                             _pretty(cost[key + "memory"])))
    return Report(rows, dict(backend.stages.graphs))


def _merge(costs: list[dict]) -> dict:
    if not costs:
        return {"form": "-", "flops": 0, "memory": 0}
    merged = {"form": " + ".join(c["form"] for c in costs),
              "flops": sum(c["flops"] for c in costs), "memory": sum(c["memory"] for c in costs)}
    if all("ghost_form" in c for c in costs):
        # A tied parameter's uses, each in its ghost form, plus their cross terms (Note [Tied
        # weights without per-sample gradients]): (B, R_k, R_l) Grams, not counted here.
        merged.update(ghost_form=" + ".join(c["ghost_form"] for c in costs) + " + cross terms",
                      ghost_flops=sum(c["ghost_flops"] for c in costs),
                      ghost_memory=sum(c["ghost_memory"] for c in costs))
    return merged


def _pretty(expr) -> str:
    expr = sympy.sympify(expr)
    subs = {s: sympy.Symbol("B") for s in expr.free_symbols if str(s).startswith(("u", "s"))}
    return str(sympy.simplify(expr.subs(subs)))


def draw(text: str, path: str) -> str:
    """A layered picture of a graph printed by ``dpfx.graph.printer``; dpfx nodes are coloured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    g = nx.DiGraph()
    tags = {}
    for line in text.splitlines()[1:]:
        line = line.strip()
        if line.startswith("input"):
            g.add_node(line.split()[1].rstrip(":"))
        elif line.startswith("%"):
            name = line.split(":", 1)[0]
            g.add_node(name)
            call = line.split(" = ", 1)[1] if " = " in line else ""
            for token in call.replace(",", " ").replace("(", " ").replace(")", " ").split():
                token = token.strip("[]")
                if token.startswith("%") and token in g and token != name:
                    g.add_edge(token, name)
            if "# dpfx:" in line:
                tags[name] = line.rsplit("# dpfx:", 1)[1].strip()
    for layer, nodes in enumerate(nx.topological_generations(g)):
        for n in nodes:
            g.nodes[n]["layer"] = layer
    pos = nx.multipartite_layout(g, subset_key="layer", align="horizontal")
    pos = {n: (x, -y) for n, (x, y) in pos.items()}
    colours = {"noise": "#e07070", "noise_scale": "#e07070", "clip_factor": "#70a0e0",
               "per_sample_norms": "#70a0e0", "clip_coef": "#70a0e0", "clip_apply": "#70c070",
               "finite_examples": "#70a0e0", "finite_mask": "#70c070",
               "clipped_sum": "#70c070", "private_grad": "#f0c040"}
    size = max(6, min(40, len(g) ** 0.5 * 2.5))
    fig, ax = plt.subplots(figsize=(size, size))
    nx.draw_networkx(g, pos, ax=ax, node_size=300, font_size=6, arrowsize=6,
                     node_color=[colours.get(tags.get(n), "#cccccc") for n in g])
    ax.set_axis_off()
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path
