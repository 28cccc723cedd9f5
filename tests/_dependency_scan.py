"""Which installed distributions each module of a package needs, read from its source with ``ast``.

Used by test_declared_dependencies.py to check pyproject.toml against the code. The
rules, and why:

* Every ``import x`` / ``from x import y`` counts, also inside functions: a lazy
  import is still needed the moment that code runs (``zero_strategy.cli`` reading a
  Hugging Face config, a checkpoint reader opening safetensors).
* ``importlib.import_module("x")`` with a literal absolute name counts as ``import x``.
* Implicit uses count too: ``tensor.numpy()`` and ``torch.from_numpy`` import numpy
  inside torch, which does not depend on numpy itself, so a plain install without
  numpy fails there with "Numpy is not available".
* Imports under ``if TYPE_CHECKING:`` never run and are skipped (``type_only=True`` keeps
  them, marked: the layering test's import graph counts them, since a circle a type checker
  must follow is still a circle in the design).
* Optional imports: an import inside ``try:`` whose handler names ``ImportError``
  or ``ModuleNotFoundError`` is the code deciding what happens without the package
  (a fallback, or an error saying what to install). It is not required where it is
  used, but it must still be installable through the project: declared in the base
  dependencies or in some extra.
* First-party imports carry requirements along (details in :func:`needed`):
  importing ``a.b.c`` also runs ``a`` and ``a.b``, so a module needs what the
  first-party modules it imports need to be imported; a front end that imports
  another front end needs everything that one needs (``zero_strategy.transformers``
  runs ``zero_strategy.accelerate``). A lazy import from a core module into a front
  end, such as ``zero_strategy.ZeroAccelerator`` resolving to
  ``zero_strategy.accelerate`` on first access, is not followed: it is the front
  end's entry point, and the front end's extra covers it.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

#: calls that use a package without importing it: attribute name -> distribution's import name
IMPLICIT_ATTRIBUTE_CALLS = {"numpy": "numpy", "from_numpy": "numpy"}
_OPTIONAL_ERRORS = {"ImportError", "ModuleNotFoundError"}


@dataclass(frozen=True)
class Use:
    """One place where ``module`` needs ``name`` (a dotted import name)."""

    module: str
    name: str
    line: int
    lazy: bool = False      # inside a function: needed when that function runs
    optional: bool = False  # guarded by ``except ImportError``
    implicit: bool = False  # not an import statement (``tensor.numpy()``)
    type_only: bool = False  # under ``if TYPE_CHECKING:``: never runs (kept only when asked for)

    @property
    def top(self) -> str:
        return self.name.split(".")[0]

    def where(self) -> str:
        how = "uses" if self.implicit else "imports"
        return f"{self.module}:{self.line} {how} {self.name}"


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, package: str, type_only: bool = False):
        self.module, self.package = module, package  # package: where relative imports start
        self.keep_type_only = type_only
        self.uses: list[Use] = []
        self._function_depth = 0
        self._optional_depth = 0
        self._type_checking_depth = 0

    def _add(self, name: str, node: ast.AST, implicit: bool = False) -> None:
        self.uses.append(Use(self.module, name, node.lineno, lazy=self._function_depth > 0,
                             optional=self._optional_depth > 0, implicit=implicit,
                             type_only=self._type_checking_depth > 0))

    def _function(self, node) -> None:
        self._function_depth += 1
        self.generic_visit(node)
        self._function_depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            if self.keep_type_only:
                self._type_checking_depth += 1
                for child in node.body:
                    self.visit(child)
                self._type_checking_depth -= 1
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        optional = any(_names_import_error(h.type) for h in node.handlers)
        self._optional_depth += optional
        for child in node.body:
            self.visit(child)
        self._optional_depth -= optional
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(child)

    visit_TryStar = visit_Try

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0:
            base = node.module
        else:
            parts = self.package.split(".")
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        # ``from pkg import sub`` may name a submodule; the resolver decides (see resolve_first_party)
        for alias in node.names:
            self._add(f"{base}.{alias.name}" if alias.name != "*" else base, node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in IMPLICIT_ATTRIBUTE_CALLS:
            self._add(IMPLICIT_ATTRIBUTE_CALLS[func.attr], node, implicit=True)
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and not node.args[0].value.startswith("."):
            self._add(node.args[0].value, node)
        self.generic_visit(node)


def _names_import_error(expr: ast.expr | None) -> bool:
    if expr is None:
        return False
    items = expr.elts if isinstance(expr, ast.Tuple) else [expr]
    return any(getattr(e, "id", getattr(e, "attr", None)) in _OPTIONAL_ERRORS for e in items)


def scan_source(source: str, module: str, is_package: bool = False, type_only: bool = False) -> list[Use]:
    """Every use in one module's source (``module``: its dotted name); ``type_only``: also the
    imports under ``if TYPE_CHECKING:``, marked ``Use.type_only``."""
    visitor = _Visitor(module, module if is_package else module.rpartition(".")[0], type_only)
    visitor.visit(ast.parse(source))
    return visitor.uses


def scan_package(root: Path, type_only: bool = False) -> dict[str, list[Use]]:
    """Dotted module name -> its uses, for every ``.py`` file of the package directory ``root``
    (``type_only``: see :func:`scan_source`)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        is_package = rel.name == "__init__"
        name = ".".join(rel.parts[:-1] if is_package else rel.parts)
        modules[name] = scan_source(path.read_text(encoding="utf-8"), name, is_package, type_only)
    return modules


def resolve_first_party(name: str, modules: dict) -> list[str]:
    """The first-party modules that ``import name`` runs: the longest known prefix and its parents."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()  # ``from pkg.mod import attr``: attr is not a module
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def front_end_of(module: str, package: str, front_ends: dict[str, str]) -> str | None:
    """The front-end subpackage (a key of ``front_ends``) holding ``module``, or None for core."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == package and parts[1] in front_ends else None


def _closure(seed: dict[str, set[Use]], edges: dict[str, set[str]]) -> dict[str, set[Use]]:
    """``seed`` grown along ``edges`` to a fixed point (import cycles are fine)."""
    out = {m: set(uses) for m, uses in seed.items()}
    changed = True
    while changed:
        changed = False
        for module, targets in edges.items():
            before = len(out[module])
            for target in targets:
                out[module] |= out[target]
            changed |= len(out[module]) != before
    return out


def needed(modules: dict[str, list[Use]], package: str, front_ends: dict[str, str]) -> dict[str, set[Use]]:
    """Module -> the required (non-optional) third-party uses it needs, see the module docstring.

    * Importing a module needs its module-level third-party imports and what its
      module-level first-party imports need *to be imported* (``at_import``).
    * Running a module's code needs all of its own uses and what every first-party
      module it imports (at module level or lazily) needs to be imported; except a
      core module's lazy import of a front end (the front end's entry point).
    * A front end that imports another front end needs everything that one needs
      (``zero_strategy.transformers`` runs ``zero_strategy.accelerate``'s code).
    """
    stdlib = set(sys.stdlib_module_names) | {"__future__"}

    def third_party(u: Use) -> bool:
        return u.top != package and u.top not in stdlib and not u.optional

    def first_party(module: str, eager_only: bool) -> set[str]:
        own_front_end = front_end_of(module, package, front_ends)
        out = set()
        for use in modules[module]:
            if use.top != package or use.optional or (eager_only and use.lazy):
                continue
            for target in resolve_first_party(use.name, modules):
                entry_point = use.lazy and own_front_end is None and \
                    front_end_of(target, package, front_ends) is not None
                if target != module and not entry_point:
                    out.add(target)
        return out

    at_import = _closure({m: {u for u in uses if third_party(u) and not u.lazy} for m, uses in modules.items()},
                         {m: first_party(m, eager_only=True) for m in modules})
    seed, across = {}, {}
    for module, uses in modules.items():
        targets = first_party(module, eager_only=False)
        seed[module] = {u for u in uses if third_party(u)}.union(*(at_import[t] for t in targets))
        mine = front_end_of(module, package, front_ends)
        across[module] = {t for t in targets if mine is not None and
                          front_end_of(t, package, front_ends) not in (None, mine)}
    return _closure(seed, across)


def optional_uses(modules: dict[str, list[Use]], package: str) -> list[Use]:
    """Third-party imports guarded by ``except ImportError`` anywhere in the package."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    return [u for uses in modules.values() for u in uses
            if u.optional and u.top != package and u.top not in stdlib]


# ------------------------------------------------------------------ pyproject side
def normalize(distribution: str) -> str:
    """PEP 503 name normalization: ``PyYAML`` and ``pyyaml`` are one distribution."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def requirement_name(spec: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    assert match, f"cannot read a distribution name from requirement {spec!r}"
    return normalize(match.group(1))


def distributions_for(import_name: str, mapping: dict[str, list[str]]) -> set[str]:
    """Distributions that provide top-level ``import_name`` (itself if none installed does)."""
    return {normalize(d) for d in mapping.get(import_name, [])} or {normalize(import_name)}


def undeclared(modules: dict[str, list[Use]], project: dict, package: str, front_ends: dict[str, str],
               mapping: dict[str, list[str]]) -> list[str]:
    """What the code needs and pyproject's ``project`` table does not declare, one line per problem.

    ``front_ends``: front-end subpackage -> the extra that must install what it needs.
    ``mapping``: import name -> distributions (``importlib.metadata.packages_distributions()``).
    """
    base = {requirement_name(r) for r in project.get("dependencies", [])}
    extras = {k: {requirement_name(r) for r in v} for k, v in project.get("optional-dependencies", {}).items()}
    anywhere = base.union(*extras.values())
    problems: set[str] = set()
    for use in optional_uses(modules, package):
        dists = distributions_for(use.top, mapping)
        if not dists & anywhere:
            problems.add(f"{use.where()} (optional), but no extra installs {sorted(dists)}")
    for module, uses in needed(modules, package, front_ends).items():
        front_end = front_end_of(module, package, front_ends)
        allowed = base | extras.get(front_ends.get(front_end), set())
        where = f"the {front_ends[front_end]!r} extra" if front_end else "the base dependencies"
        first: dict[tuple, Use] = {}  # one line per (module, distribution): its first use
        for use in sorted(uses, key=lambda u: (u.module, u.line)):
            dists = distributions_for(use.top, mapping)
            if not dists & allowed:
                first.setdefault(tuple(sorted(dists)), use)
        for dists, use in first.items():
            problems.add(f"{module} needs {list(dists)} (e.g. {use.where()}); not declared in {where}")
    return sorted(problems)
