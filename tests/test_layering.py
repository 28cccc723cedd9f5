"""The package's layers, read off its imports: nothing imports upward, nothing imports in a circle.

The layers, lowest first, are the table ``LAYERS`` below (docs/architecture.md draws
them). A module may import modules of its own layer and of the layers below it, at
module level or inside a function alike: a lazy import still runs, and a circle that
closes through one is still a circle, only hidden. ``if TYPE_CHECKING:`` imports
never run and are left out. When this test fails, the fix is a move, not a lazy
import: put the name both sides need into a module of the lower layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _dependency_scan import resolve_first_party, scan_package

PACKAGE = "zero_strategy"
SOURCE = Path(__file__).resolve().parents[1] / "src" / PACKAGE

#: (layer, the module prefixes it holds), lowest first; "" is the package's own __init__
LAYERS = [
    ("leaves", ["_logging", "_version"]),
    ("configuration", ["_config", "config"]),
    ("communication", ["_comm"]),
    ("mechanisms", ["_mechanisms"]),
    ("engine", ["_engine"]),
    ("optimizer step", ["_optim"]),
    ("planning", ["estimate", "_estimate_activations", "_estimate_working_set", "_zero_auto"]),
    ("plain-PyTorch API", ["api"]),
    ("checkpoints", ["checkpoint"]),
    ("command line", ["cli"]),
    ("front ends", ["lightning", "accelerate"]),
    ("Hugging Face trainers", ["transformers"]),
    # the facade, and the start-up hook a .pth file runs to import it when Lightning is imported
    ("package facade", ["", "lightning._autoregister_hook"]),
]


def layer_of(module: str) -> int:
    """The layer of the longest prefix in ``LAYERS`` that names ``module`` or a package above it."""
    rest = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if rest == prefix or (prefix and rest.startswith(prefix + "."))]
    assert matches, f"{module} is in no layer of tests/test_layering.py: add it to LAYERS"
    return max(matches)[1]


def import_edges() -> dict[str, dict[str, int]]:
    """module -> {imported first-party module: line of the first such import}."""
    modules = scan_package(SOURCE)
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, uses in modules.items():
        for use in uses:
            if use.top != PACKAGE or use.implicit:
                continue
            target = resolve_first_party(use.name, modules)[-1]
            if target != module:
                edges[module].setdefault(target, use.line)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def edges():
    return import_edges()


def test_every_module_is_in_a_layer(edges):
    for module in edges:
        layer_of(module)


def test_no_module_imports_a_higher_layer(edges):
    upward = []
    for module, targets in sorted(edges.items()):
        for target, line in sorted(targets.items()):
            if layer_of(target) > layer_of(module):
                upward.append(f"{module}:{line} ({LAYERS[layer_of(module)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, ("imports that go up a layer; move the shared name down instead:\n"
                        + "\n".join(upward))


def test_no_import_cycles(edges):
    found = cycles(edges)
    assert not found, "import cycles (lazy imports included):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_scan_sees_the_engine_import_its_layers(edges):
    """A guard on the scan: an empty graph would pass the two tests above."""
    engine = edges[f"{PACKAGE}._engine.engine"]
    assert f"{PACKAGE}._comm.collectives" in engine and f"{PACKAGE}._engine.units" in engine
    assert cycles({"a": {"b": 1}, "b": {"a": 2}}) == [["a", "b"]]


def test_the_architecture_page_names_every_core_module(edges):
    """docs/architecture.md is the map: a module added, moved or renamed below the front ends
    must appear there under its path, or the map goes stale."""
    page = (SOURCE.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    front_ends = ("lightning", "accelerate", "transformers", "checkpoint")
    missing = []
    for module in edges:
        rest = module[len(PACKAGE) + 1:]
        if not rest or rest.split(".")[0] in front_ends or rest.endswith("__init__"):
            continue
        path = rest.replace(".", "/") + ("/" if (SOURCE / rest.replace(".", "/")).is_dir() else ".py")
        if path not in page:
            missing.append(path)
    assert not missing, f"docs/architecture.md does not name {missing}"


#: the engine internals a front end may name: the stage table and the optimizer class users hold
FRONT_END_MAY_IMPORT = {f"{PACKAGE}._engine.plan", f"{PACKAGE}._optim.optimizer"}
ENGINE_INTERNALS = ("_comm", "_mechanisms", "_engine", "_optim")


def test_front_ends_hold_no_sharding_logic(edges):
    """Front ends translate a framework's objects into setup() calls; they reach the engine
    through api.py, so nothing that gathers, reduces or steps can grow inside one."""
    reached = []
    for module, targets in sorted(edges.items()):
        if module.split(".")[1:2] not in (["lightning"], ["accelerate"], ["transformers"]):
            continue
        for target, line in sorted(targets.items()):
            if target.split(".")[1:2] and target.split(".")[1] in ENGINE_INTERNALS \
                    and target not in FRONT_END_MAY_IMPORT:
                reached.append(f"{module}:{line} imports {target}")
    assert not reached, "front ends reaching into the engine (go through zero_strategy.api):\n" + "\n".join(reached)
