"""How many of the package's files a reader must open to follow the engine: a map, not a timing.

Four figures, each a proxy for how easy the code is to follow (issue 37 set the targets):

* **step**: the distinct ``src/zero_strategy`` files entered (any thread) during one
  forward + backward + ``optimizer.step()`` of a tiny model set up with
  ``{"stage": 3, "offload_optimizer": "cpu"}`` in one process, every unit sharded
  (``param_persistence_threshold=0``), (target: at most 12);
* **pre-forward**: the files one unit's forward pre-hook enters, and its calls into the
  package, for the first block (target: at most 6);
* **circles**: strongly connected components of the import graph of ``src/``, with
  ``TYPE_CHECKING`` and function-level imports counted (target: none);
* **engine closure**: the package modules ``import zero_strategy._engine.engine`` runs
  (module-level imports, the package's own ``__init__`` not run, so the figure is the
  engine's own), and the larger set its function-level imports can reach.

Where it stood (the files cut by concept in issue 37's second round, 2026-12-07): the step
entered 21 files before and 12 after (the collectives' counters and waits into
``_comm/collectives.py``; the gradient buffer, its markers and the step agreement into
``_engine/gradients.py``; the group gathers into ``_engine/units.py``; the working set, the host
pool and the release of freed memory into ``_mechanisms/memory.py``; the worker threads into
``_mechanisms/transfers.py``; the loss scale into ``_optim/optimizer.py``), the pre-forward 8
before and 6 after, with no circle either time. docs/architecture.md shows the step's path.

Steady state is traced: one untraced step first, so first-use imports and lazy setup do not
count. Run from the repository root::

    python benchmarks/code_paths.py            # prints the table
    python benchmarks/code_paths.py --json out.json
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: issue 37's targets, and the figures before its files were cut by concept (2026-12-07)
STEP_TARGET, STEP_BEFORE = 12, 21
PRE_FORWARD_TARGET, PRE_FORWARD_BEFORE = 6, 8
SOURCE = ROOT / "src" / "zero_strategy"
sys.path.insert(0, str(ROOT / "src"))


def _rel(filename: str) -> str | None:
    try:
        return Path(filename).resolve().relative_to(SOURCE).as_posix()
    except ValueError:
        return None


class _Files:
    """Distinct package files (and the number of calls into the package) seen while ``on``."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.calls = 0
        self.on = False

    def __call__(self, frame, event, arg):
        if self.on and event == "call":
            rel = _rel(frame.f_code.co_filename)
            if rel is not None:
                self.files.add(rel)
                self.calls += 1
        return None


def trace_step() -> dict:
    import torch
    from torch import nn

    import zero_strategy as zs

    class Block(nn.Module):
        def __init__(self, dim: int):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    class Tiny(nn.Module):
        def __init__(self, dim: int = 16, layers: int = 3):
            super().__init__()
            self.inp = nn.Linear(dim, dim)
            self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
            self.out = nn.Linear(dim, 1)

        def forward(self, x):
            h = self.inp(x)
            for block in self.layers:
                h = block(h)
            return self.out(h).sum()

    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = zs.setup(model, optimizer, {"stage": 3, "offload_optimizer": "cpu",
                                                    "param_persistence_threshold": 0})  # every unit sharded
    x = torch.randn(4, 16)

    def step() -> None:
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # untraced: first-use imports and lazy setup
    whole, pre = _Files(), _Files()
    block = model.layers[0]

    def wrap(hook):
        def traced(*args, **kwargs):
            pre.on = True
            try:
                return hook(*args, **kwargs)
            finally:
                pre.on = False
        return traced

    hooks = block._forward_pre_hooks
    originals = dict(hooks)
    for key, hook in originals.items():
        hooks[key] = wrap(hook)

    def both(frame, event, arg):
        whole(frame, event, arg)
        pre(frame, event, arg)

    whole.on = True
    threading.setprofile(both)
    sys.setprofile(both)
    try:
        step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        whole.on = False
        hooks.update(originals)
    return {"step_files": sorted(whole.files), "step_calls": whole.calls,
            "pre_forward_files": sorted(pre.files), "pre_forward_calls": pre.calls}


# ------------------------------------------------------------------------ the import graph
def _module_name(path: Path) -> str:
    rel = path.relative_to(SOURCE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(first-party dotted name imported, at module level) for every import, TYPE_CHECKING ones too."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = False  # never runs: a graph edge, not part of the runtime closure
            if isinstance(child, ast.Import):
                out.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                out.extend((f"{base}.{a.name}", top) for a in child.names)  # the longest module prefix counts
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), True)
    return [(n, top) for n, top in out if n.split(".")[0] == "zero_strategy"]


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(every edge, module-level edges only) between package modules."""
    paths = {_module_name(p): p for p in SOURCE.rglob("*.py")}
    every: dict[str, set[str]] = {m: set() for m in paths}
    runtime: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        for name, top in _imports(path):
            parts = name.split(".")
            while parts and ".".join(parts) not in paths:
                parts.pop()
            target = ".".join(parts)
            if target and target != module:
                every[module].add(target)
                if top:
                    runtime[module].add(target)
    return every, runtime


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def reach(edges: dict[str, set[str]], start: str) -> list[str]:
    seen, todo = {start}, [start]
    while todo:
        for w in edges[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    seen.discard(start)
    return sorted(m for m in seen if m != "zero_strategy")


_LOADED = """
import importlib.util, sys, types
pkg = types.ModuleType("zero_strategy"); pkg.__path__ = [sys.argv[1]]  # the package, its __init__ not run
sys.modules["zero_strategy"] = pkg
import zero_strategy._engine.engine
print("\\n".join(sorted(m for m in sys.modules if m.startswith("zero_strategy.") and m != "zero_strategy._engine.engine")))
"""


def engine_loads() -> list[str]:
    out = subprocess.run([sys.executable, "-c", _LOADED, str(SOURCE)], capture_output=True, text=True, check=True)
    return out.stdout.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    every, runtime = import_graph()
    result = {**trace_step(), "circles": circles(every),
              "engine_runtime_closure": engine_loads(),
              "engine_static_closure": reach(every, "zero_strategy._engine.engine")}
    print(f"step (stage 3, CPU offload): {len(result['step_files'])} files, {result['step_calls']} calls "
          f"(target: at most {STEP_TARGET}; {STEP_BEFORE} before issue 37's cut by concept)")
    for f in result["step_files"]:
        print(f"    {f}")
    print(f"one unit's pre-forward: {len(result['pre_forward_files'])} files, {result['pre_forward_calls']} calls "
          f"(target: at most {PRE_FORWARD_TARGET}; {PRE_FORWARD_BEFORE} before)")
    for f in result["pre_forward_files"]:
        print(f"    {f}")
    print(f"circles (TYPE_CHECKING and lazy imports counted): {len(result['circles'])}")
    for c in result["circles"]:
        print(f"    {len(c)}: {' <-> '.join(c)}")
    print(f"import zero_strategy._engine.engine loads {len(result['engine_runtime_closure'])} package modules:")
    for m in result["engine_runtime_closure"]:
        print(f"    {m}")
    print(f"with its function-level imports it can reach {len(result['engine_static_closure'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
