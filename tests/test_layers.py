"""dpfx's layers: imports point down them, and no module imports itself back through others.

The layers, lowest first (docs/ARCHITECTURE.md, "Layers"). A module may import from its own
layer or a lower one. Imports inside functions count: an import put in a function to hide a
cycle is still the cycle.
"""
import ast
import os

import networkx as nx
import pytest

import dpfx

ROOT = os.path.dirname(os.path.abspath(dpfx.__file__))

# Every module, by its name under dpfx (``__init__``: the package's own, the public re-exports).
# A module is placed by its exact name, never by a prefix, so a new file fails
# test_every_module_is_placed until it is written here (and in docs/ARCHITECTURE.md's table).
# A listed name needs no file yet.
LAYERS = [
    # 0 base: errors, settings, FX tools, dpfx:: ops, accounting
    """errors config options
       graph graph.batch graph.emit graph.printer graph.rng_wrappers graph.tags
       ops ops.blocks ops.conv ops.loss ops.native ops.noise ops.norms
       privacy privacy.adaptive privacy.budget privacy.checkpoint privacy.durable privacy.ledger
       privacy.recursion privacy.strategies privacy.strategy_fit privacy.matrix_accounting
       privacy.plan privacy.validate""",
    # 1 rules
    """rules rules.block rules.convolution rules.embedding rules.fallback rules.lift rules.linear
       rules.reduction rules.registry""",
    # 2 passes and proofs
    """passes passes.block passes.clip_noise passes.indexing passes.per_sample passes.schedule
       passes.stack_time
       passes.verify passes.verify.adaptive passes.verify.backward passes.verify.block
       passes.verify.clip passes.verify.forward passes.verify.noise passes.verify.patterns
       passes.verify.release""",
    # 3 capture
    """capture capture.batch_branches capture.entry capture.errors capture.modules
       capture.requires_grad_skip capture.rnn capture.swaps""",
    # 4 lowering
    """lower lower.cpu_builds lower.codegen_patches lower.shape_patches lower.inductor lower.trust
       lower.warm
       lower.selfcheck lower.selfcheck.batches lower.selfcheck.check lower.selfcheck.compare
       lower.selfcheck.grow lower.selfcheck.markers lower.selfcheck.reference
       lower.selfcheck.stream""",
    # 5 the loss and the release gate
    """loss loss.arranged loss.backward loss.captured loss.check loss.form loss.gate
       loss.hf_labels loss.inputs loss.program loss.replay loss.scale loss.verdict_key loss.trace
       loss.track loss.verdicts""",
    # 6 the backend
    """backend backend.checks backend.inputs backend.runtime
       blocks blocks.call blocks.capture blocks.kernels blocks.prepare blocks.selfcheck
       blocks.sizes""",
    # 7 the loop around the graph
    """loop loop.data loop.fsdp loop.grads loop.noise loop.optim loop.ranks loop.checks
       loop.step_noise loop.users loop.samplers loop.correlated loop.adambc""",
    # 8 the public API
    "api block_install compiled_call engine grad_guards",
    # 9 integrations and reports
    """__init__ hf hf.trainer hf.resume hf.ranks hf.users trl trl._private trl.dpo trl.sft
       report report.explain report.history report.validate
       audit audit.__main__ audit.losses audit.steps
       opacus opacus.layers opacus.privacy_engine opacus.utils opacus.utils.batch_memory_manager
       opacus.validators opacus.validators.errors opacus.validators.module_validator""",
]
PLACE = {("dpfx" if name == "__init__" else "dpfx." + name): rank
         for rank, names in enumerate(LAYERS) for name in names.split()}


def layer_of(module: str) -> int:
    assert module in PLACE, f"{module} is in no layer: add it to LAYERS and to ARCHITECTURE.md"
    return PLACE[module]


def unplaced(found: dict[str, str]) -> list[str]:
    return sorted(m for m in found if m not in PLACE)


def modules(root: str = ROOT) -> dict[str, str]:
    found = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
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


def test_every_module_is_placed():
    assert not unplaced(modules()), f"modules in no layer: {unplaced(modules())}"


def test_an_unplaced_module_fails(tmp_path):
    """The check itself: a new file in a placed package, or beside one whose name it extends, is in
    no layer until it is listed."""
    package = tmp_path / "dpfx"
    (package / "loop").mkdir(parents=True)
    for f in ("__init__.py", "hf.py", "hf_planted.py", "loop/__init__.py", "loop/optim.py",
              "loop/planted.py"):
        (package / f).write_text("")
    found = modules(str(package))
    assert set(found) == {"dpfx", "dpfx.hf", "dpfx.hf_planted", "dpfx.loop", "dpfx.loop.optim",
                          "dpfx.loop.planted"}
    assert unplaced(found) == ["dpfx.hf_planted", "dpfx.loop.planted"]
    with pytest.raises(AssertionError, match="dpfx.loop.planted is in no layer"):
        layer_of("dpfx.loop.planted")


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


# -- private names stay in their package ---------------------------------------------------------


def _package(module: str, found: dict[str, str]) -> str:
    return module if found[module].endswith("__init__.py") else module.rsplit(".", 1)[0]


def private_imports(module: str, path: str, found: dict[str, str]) -> list[str]:
    """``owner._name`` for every private name ``module`` takes from a module of another package:
    ``from dpfx.x import _name``, or ``x._name`` on an imported dpfx module."""
    tree = ast.parse(open(path).read(), path)
    mine = _package(module, found)
    aliases, out = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dpfx":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in found:
                    aliases[a.asname or a.name] = full
                elif a.name.startswith("_") and node.module in found \
                        and _package(node.module, found) != mine:
                    out.append(f"{node.module}.{a.name} (line {node.lineno})")
        elif isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in found})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            owner = aliases[node.value.id]
            if _package(owner, found) != mine:
                out.append(f"{owner}.{node.attr} (line {node.lineno})")
    return out


# The options, the privacy plan, the loop, the public API and the integrations: a helper another
# package needs is public (privacy/validate.py, hf/resume.py), not borrowed.
PUBLIC_ONLY = ("dpfx.privacy", "dpfx.options", "dpfx.config", "dpfx.engine", "dpfx.loop",
               "dpfx.api", "dpfx.compiled_call", "dpfx.block_install", "dpfx.grad_guards",
               "dpfx.hf", "dpfx.trl", "dpfx.opacus", "dpfx.audit", "dpfx.report")


def test_no_module_takes_another_packages_private_names():
    found = modules()
    borrowed = {m: private_imports(m, path, found) for m, path in found.items()
                if m.startswith(PUBLIC_ONLY)}
    assert {m: names for m, names in borrowed.items() if names} == {}


def test_the_private_name_check_finds_a_borrowed_name(tmp_path):
    package = tmp_path / "dpfx"
    (package / "loop").mkdir(parents=True)
    (package / "privacy").mkdir()
    found = {"dpfx.privacy": str(package / "privacy" / "__init__.py"),
             "dpfx.loop.data": str(package / "loop" / "data.py"),
             "dpfx.loop.users": str(package / "loop" / "users.py")}
    (package / "privacy" / "__init__.py").write_text("def _check(q): return q\n")
    (package / "loop" / "data.py").write_text(
        "from dpfx.privacy import _check\nfrom dpfx import privacy\nprivacy._check(1)\n")
    (package / "loop" / "users.py").write_text("from dpfx.loop.data import _size\n")
    assert private_imports("dpfx.loop.data", found["dpfx.loop.data"], found) == [
        "dpfx.privacy._check (line 1)", "dpfx.privacy._check (line 3)"]
    assert private_imports("dpfx.loop.users", found["dpfx.loop.users"], found) == []


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
