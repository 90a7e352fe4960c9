"""The layout of stages/: no import circle among its modules, and every stage's CLI starts.

The graph has an edge A -> B for every `import stages...` / `from stages... import ...` in A that names
module B, at the top of the file or inside a function (a function-level import closes a circle as
surely, only later). `from stages.train import packing` is an edge to the submodule packing, not to the
package's __init__; `from stages import train` is an edge to stages/train/__init__.py. Importing a
submodule also runs its package's __init__: not counted, as the packages' __init__ import nothing
at their top. Imports under `if TYPE_CHECKING:` never run and are not counted.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

STAGES = REPO / "stages"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import statement that can run: top level, in functions and classes, not under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in sorted(STAGES.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
                continue
            base = node.module or ""
            if node.level:  # relative: from the package this file is in
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in files:
                    edges.add(sub)
                elif base in files:
                    edges.add(base)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_graph_sees_the_imports():
    g = import_graph()
    assert "stages.train.model" in g["stages.train.stage"]           # top level, from a sibling
    assert "stages.train.stage" in g["stages.train"]                   # the package's lazy API
    assert "stages.train.hf_trainer" in g["stages.preflight"]          # inside a function
    assert "stages.model.architecture" in g["stages.train.sharding"]         # decoder_layers
    assert "stages.config" not in g["stages.model.load"]               # only under TYPE_CHECKING
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_circle_among_stages_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _python(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("stage", ["preflight", "train", "merge", "export", "smoke"])
def test_every_stage_cli_starts(stage):
    p = _python("-m", f"stages.{stage}", "--help")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "--config" in p.stdout


def test_a_stage_package_loads_its_stage_only_when_asked():
    """The preflight reads pieces of training without loading the train stage (the Trainer, peft, accelerate); llama.cpp's
    child process imports the export package without torch."""
    p = _python("-c", "import sys, stages.preflight, stages.export.llamacpp_process as c; "
                      "print(sorted(m for m in ('stages.train.stage', 'stages.export.stage', 'peft', 'transformers') if m in sys.modules))")
    assert p.returncode == 0 and p.stdout.split() == ["[]"], p.stdout + p.stderr[-3000:]
    p = _python("-c", "import sys, stages.export.llamacpp_process; assert 'torch' not in sys.modules, 'torch imported'")
    assert p.returncode == 0, p.stderr[-3000:]
    p = _python("-c", "from stages import export, train; print(train.run.__module__, export.run.__module__, train.TrainOOMError.__name__)")
    assert p.returncode == 0 and p.stdout.split() == ["stages.train.stage", "stages.export.stage", "TrainOOMError"], p.stderr[-3000:]


# The floors of stages/, lowest first. The ground (the schema, paths, errors, memory measurement, data, the base model
# and its experts in model/) serves every stage; the stages' pieces (train/, with the analytic memory model, which is
# arithmetic on the train stage's own settings and which training reads too, to size its packed budget; export/, merge,
# smoke) build on it; the modules that check or decide across stages (the preflight and its checks, the hand-off and its
# champion comparison) sit on top. An import points down or sideways, never up.
TOP = {"stages.preflight", "stages.checks", "stages.handoff", "stages.champion"}
PIECES = {"stages.merge", "stages.smoke"}


def floor(module: str) -> int:
    if module in TOP:
        return 2
    if module.startswith(("stages.train", "stages.export")) or module in PIECES:
        return 1
    return 0


def test_no_import_points_up_a_floor():
    up = [f"{m} -> {d}" for m, deps in import_graph().items() for d in sorted(deps) if floor(d) > floor(m)]
    assert not up, "imports up a floor: " + "; ".join(up)
    assert floor("stages.config") == 0 and floor("stages.train.stage") == 1 and floor("stages.preflight") == 2


# Outside train/, only the preflight reads pieces of the train stage (what `auto` resolves to, the packing, the plan for
# the card, the estimate), and its checks the tracking store the stage will write to. Nothing else does: not the ground,
# not the other stages, so training is never loaded, nor a circle closed, by a module that merely sits beside it.
TRAIN_READERS = {"stages.preflight", "stages.checks"}


def in_train(module: str) -> bool:
    return module == "stages.train" or module.startswith("stages.train.")


def test_only_the_preflight_imports_the_train_stage_from_outside_it():
    readers = {m: sorted(filter(in_train, deps)) for m, deps in import_graph().items() if not in_train(m)}
    strays = {m: deps for m, deps in readers.items() if deps and m not in TRAIN_READERS}
    assert not strays, f"imports of stages.train from outside it (only {sorted(TRAIN_READERS)} may): {strays}"
    assert readers["stages.preflight"] and "stages.train.memory_model" in import_graph()["stages.train.widen"]


def config_json_reads() -> list[str]:
    """Every read of a model's config.json in stages/ (`.read_text()`, `.read_bytes()`, `.open()` or `open()` of an
    expression naming "config.json", directly or through a name assigned one), as `<file>:<line>`."""
    def names_it(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Constant) and n.value == "config.json" for n in ast.walk(node))

    found = set()
    for path in sorted(STAGES.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
            held = {t.id for node in ast.walk(scope) if isinstance(node, ast.Assign) and names_it(node.value)
                    for t in node.targets if isinstance(t, ast.Name)} if scope is not tree else set()
            for node in ast.walk(scope):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                target = (f.value if isinstance(f, ast.Attribute) and f.attr in ("read_text", "read_bytes", "open") else
                          node.args[0] if isinstance(f, ast.Name) and f.id == "open" and node.args else None)
                if target is not None and (names_it(target) or (isinstance(target, ast.Name) and target.id in held)):
                    found.add(f"{path.relative_to(REPO)}:{node.lineno}")
    return sorted(found)


def test_config_json_is_read_in_one_place():
    """stages.model.directory.config_text is the one reader of a model's config.json; everything else asks it."""
    reads = config_json_reads()
    assert len(reads) == 1 and reads[0].startswith("stages/model/directory.py:"), reads


def test_nothing_in_stages_imports_prefect_or_the_flows():
    for path in sorted(STAGES.rglob("*.py")):
        names = {a.name.split(".")[0] for node in _imports(ast.parse(path.read_text())) for a in node.names} | {
            (node.module or "").split(".")[0] for node in _imports(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)}
        assert not names & {"prefect", "flows"}, f"{path.relative_to(REPO)} imports {sorted(names & {'prefect', 'flows'})}"


def function_lengths() -> dict[str, int]:
    """Every function and method in stages/ -> its length in lines, by `<file>:<name>`."""
    out = {}
    for path in sorted(STAGES.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{path.relative_to(REPO)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


# Not yet split: each may shrink, none may grow; every other function stays within LONGEST.
LONGEST = 80
NOT_YET_SPLIT: dict[str, int] = {}


def test_no_function_in_stages_is_longer_than_a_screenful():
    lengths = function_lengths()
    long = {n: n_lines for n, n_lines in lengths.items() if n_lines > NOT_YET_SPLIT.get(n, LONGEST)}
    assert not long, f"longer than {LONGEST} lines (or than it was): {long}"
    assert all(lengths.get(n, 0) > LONGEST for n in NOT_YET_SPLIT), "split: remove it from NOT_YET_SPLIT"
    # the train stage reads as its steps: the OOM policy, the attempt, the result are functions of their own
    assert lengths["stages/train/stage.py:run"] <= 60, lengths["stages/train/stage.py:run"]


def test_the_flow_runs_the_six_stages_in_order():
    src = (REPO / "flows" / "train_and_export.py").read_text()
    flow = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "train_and_export")
    tasks = sorted((n.lineno, n.col_offset, n.id) for n in ast.walk(flow) if isinstance(n, ast.Name) and n.id.endswith("_task"))
    assert [t[2] for t in tasks] == ["preflight_task", "train_task", "merge_task", "export_task", "smoke_task", "handoff_task"]
    body = flow.end_lineno - flow.body[0].lineno + 1   # from its docstring to its last line
    assert body <= 25, f"the flow body is {body} lines: its plumbing belongs in the helpers beside it"
    assert not [n for n in ast.walk(flow) if isinstance(n, (ast.ListComp, ast.DictComp, ast.SetComp, ast.GeneratorExp))]


def test_the_readme_floor_plan_names_every_module_on_its_floor():
    """README's Layout table is redrawn whenever a module is added to stages/: each one named on the floor this file gives it."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index("| floor | modules |")
    top, pieces, ground = lines[start + 2:start + 5]
    rows = {2: top, 1: pieces, 0: ground}
    missing = [f"{path.stem} (floor {floor('stages.' + path.stem)})" for path in sorted(STAGES.glob("*.py"))
               if path.stem != "__init__" and f"`{path.stem}`" not in rows[floor("stages." + path.stem)]]
    missing += [f"{pkg}/ (floor 1)" for pkg in ("train", "export") if f"`{pkg}/`" not in pieces]
    missing += [f"{pkg}/ (floor 0)" for pkg in ("model", "model/experts") if f"`{pkg}/`" not in ground]
    missing += [f"model/{path.relative_to(STAGES / 'model')} (floor 0)" for path in sorted((STAGES / "model").rglob("*.py"))
                if path.stem != "__init__" and f"`{path.stem}`" not in ground]
    assert not missing, "README's Layout table lacks, on its floor: " + ", ".join(missing)
