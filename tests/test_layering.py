"""The package's layers, read off its imports: nothing imports upward, nothing imports in a circle.

The layers, lowest first, are the table ``LAYERS`` below (docs/architecture.md draws
them). A module may import modules of its own layer and of the layers below it, at
module level, inside a function or under ``if TYPE_CHECKING:`` alike: a lazy import
still runs, a type-only import is still a dependency a reader (and a type checker) must
follow, and a circle that closes through either is still a circle, only hidden. When
this test fails, the fix is a move, not a lazy or type-only import: put the name both
sides need into a module of the lower layer, or hand the lower module a narrow context
instead of the object above it.

Three more rules hold the split of the engine (issue 37): inside ``_engine/`` (the training
core) only ``engine.py`` names ``ZeroEngine``; front ends take from ``api.py`` only the names
in its ``__all__``; below the front ends only ``_model/hf.py`` names transformers or peft.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from _dependency_scan import resolve_first_party, scan_package

PACKAGE = "zero_strategy"
SOURCE = Path(__file__).resolve().parents[1] / "src" / PACKAGE

#: (layer, the module prefixes it holds), lowest first; "" is the package's own __init__
LAYERS = [
    ("leaves", ["_logging", "_user_warnings", "_version"]),
    ("configuration", ["_config", "config"]),
    ("communication", ["_comm"]),
    ("mechanisms", ["_mechanisms"]),
    ("engine", ["_engine"]),
    # a set-up model's surface outside the step: imports the engine, never imported by it
    ("model surface", ["_model"]),
    ("optimizer step", ["_optim"]),
    ("planning", ["estimate", "_estimate_activations", "_estimate_working_set", "_estimate_machine", "_zero_auto"]),
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
    modules = scan_package(SOURCE, type_only=True)
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
    assert not found, "import cycles (lazy and TYPE_CHECKING imports included):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_scan_sees_the_engine_import_its_layers(edges):
    """A guard on the scan: an empty graph would pass the two tests above."""
    engine = edges[f"{PACKAGE}._engine.engine"]
    assert f"{PACKAGE}._comm.collectives" in engine and f"{PACKAGE}._engine.units" in engine
    assert cycles({"a": {"b": 1}, "b": {"a": 2}}) == [["a", "b"]]
    # a TYPE_CHECKING import is an edge too
    assert f"{PACKAGE}._engine.engine" in edges[f"{PACKAGE}._model.state_dict"]


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


def test_only_engine_py_names_the_engine_inside_the_core():
    """``_engine/`` is the training core: a module in it that needs the engine takes a narrow
    context (FSDP2's ``FSDPCommContext``), never ``ZeroEngine``, not even for a type hint."""
    naming = [f"_engine/{path.name}:{n}" for path in sorted((SOURCE / "_engine").glob("*.py"))
              if path.name != "engine.py"
              for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if "ZeroEngine" in line]
    assert not naming, "modules of _engine/ other than engine.py name ZeroEngine:\n" + "\n".join(naming)


FRONT_END_PACKAGES = ("lightning", "accelerate", "transformers")


def _api_all() -> set[str]:
    tree = ast.parse((SOURCE / "api.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("api.py has no __all__")


def _names_taken_from_api(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, name) for every name ``module`` takes from zero_strategy.api: ``from ..api import x``,
    and ``api.x`` after ``from .. import api [as zs]`` or ``import zero_strategy.api``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module.rpartition(".")[0]
    taken, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                if base == f"{PACKAGE}.api":
                    taken.append((node.lineno, alias.name))
                elif base == PACKAGE and alias.name == "api":
                    aliases.add(alias.asname or "api")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == f"{PACKAGE}.api":
                    aliases.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in aliases:
            taken.append((node.lineno, node.attr))
    return taken


def test_front_ends_take_only_public_names_from_api():
    """A front end reaches the engine through api.py, and only through the names api.py exports:
    a private helper or a re-exported engine internal taken from there is the same reach into the
    engine that test_front_ends_hold_no_sharding_logic forbids, one module removed."""
    public = _api_all()
    taken = []
    for path in sorted(SOURCE.rglob("*.py")):
        rel = path.relative_to(SOURCE.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if rel.parts[1] not in FRONT_END_PACKAGES:
            continue
        taken += [f"{module}:{line} takes {name}" for line, name in _names_taken_from_api(path, module)
                  if name not in public]
    assert not taken, "front ends taking names api.py does not export (add a public primitive):\n" + "\n".join(taken)


#: the entry points users call, which may name Hugging Face's libraries: the three front ends and
#: the command line (``zero-strategy estimate --model`` reads a transformers config)
HF_ENTRY_POINTS = (*FRONT_END_PACKAGES, "cli")
HF_ADAPTER = "_model/hf.py"
_HF_MODULE = re.compile(r"^(transformers|peft)(\.|$)")


def _hf_names(path: Path) -> list[tuple[int, str]]:
    """(line, name) where the module imports transformers or peft (any import, lazy or guarded), or
    looks one of their modules up by name (``sys.modules.get("peft.peft_model")``,
    ``importlib.import_module("transformers")``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _HF_MODULE.match(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and _HF_MODULE.match(node.module or ""):
            found.append((node.lineno, node.module))
        elif isinstance(node, (ast.Call, ast.Subscript)):
            target = ast.unparse(node.func if isinstance(node, ast.Call) else node.value)
            if "sys.modules" in target or target.endswith(("import_module", "find_spec")):
                args = node.args if isinstance(node, ast.Call) else [node.slice]
                found += [(node.lineno, a.value) for a in args
                          if isinstance(a, ast.Constant) and isinstance(a.value, str) and _HF_MODULE.match(a.value)]
    return found


def test_only_one_module_below_the_front_ends_names_transformers_or_peft():
    """All of one library's naming in one adapter (torchtitan's ``state_dict_adapter.py``): the
    engine and a set-up model's surface reach transformers and PEFT only through _model/hf.py."""
    naming = []
    for path in sorted(SOURCE.rglob("*.py")):
        rel = path.relative_to(SOURCE).as_posix()
        if rel.split("/")[0].removesuffix(".py") in HF_ENTRY_POINTS or rel == HF_ADAPTER:
            continue
        naming += [f"{rel}:{line} names {name}" for line, name in _hf_names(path)]
    assert not naming, f"only {HF_ADAPTER} may import or look up transformers/peft below the front ends:\n" \
        + "\n".join(naming)
    assert _hf_names(SOURCE / HF_ADAPTER), "the scan finds nothing in the adapter itself: it is broken"


#: the torch.distributed calls that communicate (or make the groups they run on)
_COLLECTIVES = {"all_to_all", "all_to_all_single", "all_reduce", "all_gather", "all_gather_into_tensor",
                "all_gather_object", "gather", "gather_object", "scatter", "scatter_object_list", "broadcast",
                "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "send", "recv",
                "isend", "irecv", "barrier", "monitored_barrier", "new_group", "new_subgroups",
                "new_subgroups_by_enumeration", "batch_isend_irecv"}
#: (module, call) outside _comm/ allowed to call torch.distributed itself, each with its reason
_KNOWN_DIRECT_COLLECTIVES: dict[tuple[str, str], str] = {}


def _direct_collectives(path: Path) -> list[tuple[int, str]]:
    """(line, call) of every ``dist.<collective>(`` / ``torch.distributed.<collective>(`` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _COLLECTIVES:
            if ast.unparse(node.func.value) in aliases:
                found.append((node.lineno, node.func.attr))
    return found


def test_collectives_only_in_the_communication_layer():
    """Every collective goes through ``_comm/``: comm_stats() counts it, its wait is bounded and a failure names
    the missing ranks (a direct call skips all three, as expert parallelism's all-to-alls once did)."""
    bad = []
    for path in sorted(SOURCE.rglob("*.py")):
        rel = path.relative_to(SOURCE).as_posix()
        if rel.startswith("_comm/"):
            continue
        module = rel[:-3].replace("/", ".")
        for line, call in _direct_collectives(path):
            if (module, call) not in _KNOWN_DIRECT_COLLECTIVES:
                bad.append(f"{rel}:{line}: torch.distributed.{call}(")
    assert not bad, "collectives outside _comm/ (add a method to _comm/collectives.py's Collectives):\n" + "\n".join(bad)
