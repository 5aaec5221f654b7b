"""dpfx's layers: imports point down them, and no module imports itself back through others.

The layers, lowest first (docs/ARCHITECTURE.md, "Layers"). A module may import from its own
layer or a lower one. Imports inside functions count: an import put in a function to hide a
cycle is still the cycle.
"""
import ast
import os

import networkx as nx

import dpfx

ROOT = os.path.dirname(os.path.abspath(dpfx.__file__))

LAYERS = [
    ["dpfx.errors", "dpfx.config", "dpfx.graph", "dpfx.ops", "dpfx.privacy"],
    ["dpfx.rules"],
    ["dpfx.passes"],
    ["dpfx.capture"],
    ["dpfx.lower"],
    ["dpfx.loss"],
    ["dpfx.backend", "dpfx.blocks"],
    ["dpfx.loop"],
    ["dpfx.api", "dpfx.engine"],
    ["dpfx.hf", "dpfx.trl", "dpfx.report", "dpfx.audit", "dpfx.opacus", "dpfx"],
]


def layer_of(module: str) -> int:
    best, rank = "", None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, rank = p, i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS and to ARCHITECTURE.md"
    return rank


def modules() -> dict[str, str]:
    found = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                found[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


def imports(module: str, path: str, known: set[str]) -> list[tuple[str, int]]:
    """(imported dpfx module, line) for every import in the file, at any depth."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "dpfx"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "dpfx":
                continue
            for a in node.names:    # `from dpfx.loss import track` imports dpfx.loss.track
                full = f"{target}.{a.name}"
                out.append((full if full in known else target, node.lineno))
    return out


def import_graph() -> nx.DiGraph:
    found = modules()
    graph = nx.DiGraph()
    for module, path in found.items():
        graph.add_node(module)
        for target, line in imports(module, path, set(found)):
            if target != module:
                graph.add_edge(module, target, line=line)
    return graph


def test_imports_point_down_the_layers():
    wrong = []
    for a, b, data in import_graph().edges(data=True):
        # a package's __init__ runs when any module below it is imported: importing it from
        # inside is allowed where it is the package itself (dpfx/__init__ re-exports)
        if b == "dpfx":
            continue
        if layer_of(b) > layer_of(a):
            wrong.append(f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)}) "
                         f"at line {data['line']}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = import_graph()
    graph.remove_node("dpfx")  # the package's re-exports import everything; nothing imports it
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles)


def test_the_check_fails_on_a_wrong_import(tmp_path):
    """The check itself: an import up the layers and a cycle are both found."""
    package = tmp_path / "dpfx"
    (package / "loss").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("from dpfx.loss import track\n")
    (package / "loss" / "__init__.py").write_text("")
    (package / "loss" / "track.py").write_text("from ..errors import PrivacyError\n")
    found = {"dpfx.errors": str(package / "errors.py"),
             "dpfx.loss.track": str(package / "loss" / "track.py")}
    edges = {m: [t for t, _ in imports(m, p, set(found))] for m, p in found.items()}
    assert edges == {"dpfx.errors": ["dpfx.loss.track"], "dpfx.loss.track": ["dpfx.errors"]}
    assert layer_of("dpfx.loss.track") > layer_of("dpfx.errors")
    graph = nx.DiGraph([(a, b) for a, bs in edges.items() for b in bs])
    assert list(nx.simple_cycles(graph))


# -- the release gate: the one writer of the release state (loss/gate.py) ---------------------


def _gate_state() -> set[str]:
    """The private attributes ReleaseGate.__init__ sets: the release state (its ``ledger`` is an
    object whose own methods write it)."""
    tree = ast.parse(open(os.path.join(ROOT, "loss", "gate.py")).read())
    gate = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ReleaseGate")
    init = next(n for n in gate.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for n in ast.walk(init) for t in _targets(n)
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self" and t.attr.startswith("_")}


def _targets(node) -> list:
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    out = []
    for t in targets:
        out += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
    return out


def writes_of_gate_state(source: str, state: set[str]) -> list[int]:
    """Lines of ``source`` that assign one of the gate's attributes, or anything on a gate."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        for t in _targets(node):
            if not isinstance(t, ast.Attribute):
                continue
            owner = t.value
            on_gate = (isinstance(owner, ast.Attribute) and owner.attr in ("gate", "_gate")) or \
                (isinstance(owner, ast.Name) and owner.id in ("gate", "_gate"))
            if t.attr in state or on_gate:
                lines.append(node.lineno)
    return lines


def test_only_the_gate_writes_the_release_state():
    state = _gate_state()
    assert {"_proven", "_hooked", "_graph_task", "_releases", "_unstepped", "_sums"} <= state
    found = []
    for module, path in modules().items():
        if module == "dpfx.loss.gate":
            continue
        found += [f"{module}:{line}" for line in
                  writes_of_gate_state(open(path).read(), state)]
    assert not found, "the release state written outside loss/gate.py: " + ", ".join(found)
    # the flags the gate replaced are gone from every module
    old = ("loss_released", "release_checked", "last_graph_task", "forward_ran", "_open_release")
    for module, path in modules().items():
        text = open(path).read()
        assert not [w for w in old if w in text], module


def test_the_gate_check_finds_a_write():
    state = _gate_state()
    assert writes_of_gate_state("backend.gate._proven = 1\n", state) == [1]
    assert writes_of_gate_state("x = 1\nself._gate.ledger = None\n", state) == [2]
    assert writes_of_gate_state("self._unstepped, y = False, 1\n", state) == [1]
    assert writes_of_gate_state("gate.proven()\nself.config = c\n", state) == []


def test_every_dpfx_op_is_defined_in_ops():
    """Every ``torch.library`` op of dpfx lives in ops/, with its kernels and fake kernel."""
    elsewhere = [m for m, path in modules().items()
                 if not m.startswith("dpfx.ops") and "torch.library" in open(path).read()]
    assert not elsewhere, elsewhere
