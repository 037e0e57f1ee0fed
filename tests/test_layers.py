"""The import layers (imports point down only), read off the source.

Run: python -m pytest -q tests/test_layers.py      (~1 s; parses the files, imports nothing)
     python tests/test_layers.py                   (the graph itself, one module a line)

Every module of the project (the top-level .py files, vm/ and plumbing/) is parsed with ast; every
import of one of our own modules, at the top or inside a function, is an edge. Then: no cycle;
nothing imports vm_server.py (it is the program a VM runs) or a trainer (train_*.py are the tops);
the top level is the design's files plus at most six more, everything else in vm/ and plumbing/;
rollout.py, the stepper both trainers play episodes with, sits below both and knows no model (no
torch: generation is the caller's policy_fn); the bottoms (actions.py, vm/procs.py, qwen_vl.py)
import nothing of ours; the model side reaches nothing of the VM side; what vm_server.py imports is
exactly vm.FILES (the files a VM needs) and none of it imports torch; no `from X import _name`
across our files; no module `__getattr__`; no `sys.modules` assignment or setdefault.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("vm", "plumbing")  # the two folders of modules; every other module is a top-level file


def _modules() -> list[str]:
    """Our modules: `x` for a top-level x.py, `vm.x` for vm/x.py (`vm` for its __init__.py)."""
    mods = [f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")]
    for pkg in PACKAGES:
        folder = os.path.join(ROOT, pkg)
        if os.path.isdir(folder):
            mods += [pkg if f == "__init__.py" else f"{pkg}.{f[:-3]}" for f in os.listdir(folder) if f.endswith(".py")]
    return sorted(mods)


OURS = _modules()


def path_of(mod: str) -> str:
    if mod in PACKAGES:
        return os.path.join(ROOT, mod, "__init__.py")
    return os.path.join(ROOT, *mod.split(".")) + ".py"


def tree(mod: str) -> ast.Module:
    with open(path_of(mod), encoding="utf-8") as f:
        return ast.parse(f.read(), path_of(mod))


def imports(mod: str) -> list[tuple[str, list[str], int]]:
    """(our module, the names taken from it, line) for every import of ours in `mod`, anywhere.
    `from vm import desktop` is an import of the module vm.desktop; `from vm import FILES`, of vm."""
    out = []
    for node in ast.walk(tree(mod)):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = [a.name for a in node.names if f"{node.module}.{a.name}" in OURS]
            out += [(f"{node.module}.{n}", [], node.lineno) for n in subs]
            rest = [a.name for a in node.names if a.name not in subs]
            if rest:
                out.append((node.module, rest, node.lineno))
    return [(m, names, line) for m, names, line in out if m in OURS and m != mod]


GRAPH = {mod: sorted({m for m, _, _ in imports(mod)}) for mod in OURS}


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one node: each holds a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in graph[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            scc = [stack.pop()]
            while scc[-1] != node:
                scc.append(stack.pop())
            if len(scc) > 1:
                found.append(sorted(scc))
    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_checks_see_what_is_there():
    # These tests pass by finding nothing, so first: they find what we know is there.
    assert {"vm.act", "plumbing.rundir", "vm"} <= set(OURS) and "plumbing.dist" in GRAPH["grpo"]
    assert "actions" in GRAPH["env"] and "vm.tasks" in GRAPH["vm_server"] and "vm.procs" in GRAPH["vm.desktop"]
    assert "vm.desktop" in GRAPH["vm_server"] and "vm.sandbox" in GRAPH["vm_server"]  # imported inside a function (only with --xvfb)
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a", "e"], "e": []}) == [["a", "b", "c"]]
    assert cycles({"a": ["b"], "b": ["a"], "c": ["c", "a"]}) == [["a", "b"]]


def test_no_cycle():
    found = cycles(GRAPH)
    assert found == [], f"import cycles: {found}"


def test_nothing_imports_vm_server():
    assert [m for m in OURS if "vm_server" in GRAPH[m]] == []


def test_trainers_are_the_tops():
    trainers = [m for m in OURS if m.startswith("train_")]
    assert trainers == ["train_arpo", "train_explore"]
    assert [m for m in OURS if set(trainers) & set(GRAPH[m])] == []


DESIGN = {"train_arpo", "train_explore", "grpo", "rewards", "model", "env", "vm_server"}


def test_the_top_level_is_the_designs_files_and_at_most_seven_more():
    # Seven since ocr.py: the screen's text (tesseract, the embedder, their cache, reading only what
    # changed) grew to ~500 lines of its own, and rewards.py stays the terms a reader comes for.
    top = {m for m in OURS if "." not in m and m not in PACKAGES}
    assert DESIGN <= top and len(top - DESIGN) <= 7, sorted(top - DESIGN)
    folders = sorted(d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d))
                     and any(f.endswith(".py") for f in os.listdir(os.path.join(ROOT, d))))
    assert [d for d in folders if d not in ("tests", "bench", "tasks")] == sorted(PACKAGES), folders


def test_each_method_is_in_its_train_script():
    # what the design puts in each file is defined there, not in a helper module
    names = {m: {n.name for n in tree(m).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} for m in OURS}
    assert {"group_advantages", "ReplayBuffer", "update_policy", "grpo_loss", "distill_step"} <= names["grpo"]
    assert {"WorldModel", "predict_and_learn", "reward", "screen_features"} <= names["rewards"]
    assert {"episode", "replay", "advantages", "select_tasks", "evaluate", "iteration"} <= names["train_arpo"]
    assert {"episode", "step_rewards", "predict_and_learn", "start_generation", "top_steps", "iteration"} <= names["train_explore"]


def test_rollout_is_below_both_trainers_and_knows_no_model():
    assert all("rollout" in GRAPH[t] for t in ("train_arpo", "train_explore"))
    assert set(GRAPH["rollout"]) <= {"env", "plumbing.progress", "actions", "vm.tasks"}, GRAPH["rollout"]
    names = [a.name for node in ast.walk(tree("rollout")) if isinstance(node, ast.Import) for a in node.names]
    names += [node.module for node in ast.walk(tree("rollout")) if isinstance(node, ast.ImportFrom) and node.module]
    assert names and not [n for n in names if n.split(".")[0] in ("torch", "transformers")], names


def test_bottoms_import_nothing_of_ours():
    for mod in ("actions", "vm.procs", "qwen_vl", "plumbing.progress"):
        assert GRAPH[mod] == [], f"{mod} imports {GRAPH[mod]}"


def test_the_model_side_reaches_nothing_of_the_vm_side():
    assert "qwen_vl" in GRAPH["model"] and "model" not in GRAPH["qwen_vl"]
    vm_side = {"vm_server", "env", "rollout"} | {m for m in OURS if m.startswith("vm")}
    for mod in ("qwen_vl", "model", "grpo", "rewards", "vllm_engine", "plumbing.warm_start"):
        assert not vm_side & set(GRAPH[mod]), f"{mod} imports {sorted(vm_side & set(GRAPH[mod]))}"


def test_no_private_name_is_imported_across_files():
    private = [(mod, line, m, n) for mod in OURS for m, names, line in imports(mod) for n in names
               if n.startswith("_")]
    assert private == [], private


def test_no_module_getattr():
    found = [mod for mod in OURS for node in tree(mod).body
             if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"]
    assert found == [], f"module __getattr__ in {found}"


def test_no_sys_modules_tricks():
    def touches_sys_modules(node: ast.AST) -> bool:
        if isinstance(node, (ast.Assign, ast.AugAssign)):  # sys.modules[...] = ...
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            return any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "sys.modules" for t in targets)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):  # sys.modules.setdefault(...)
            return ast.unparse(node.func.value) == "sys.modules" and node.func.attr in ("setdefault", "update", "__setitem__")
        return False
    found = [(mod, node.lineno) for mod in OURS for node in ast.walk(tree(mod)) if touches_sys_modules(node)]
    assert found == [], found


def test_a_vm_needs_exactly_the_files_vm_files_names():
    # What vm_server.py imports, at any depth, lies inside vm.FILES (vm_server.py, actions.py, vm/),
    # and nothing there imports torch or the trainer side: copying those files is putting it in a VM.
    from vm import FILES
    seen, todo = set(), ["vm_server"]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo += GRAPH[mod]
    files = {os.path.relpath(path_of(m), ROOT).split(os.sep)[0] for m in seen}
    assert files == set(FILES), files
    heavy = [(m, a.name) for m in seen for node in ast.walk(tree(m)) if isinstance(node, (ast.Import, ast.ImportFrom))
             for a in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
             if a.name.split(".")[0] in ("torch", "transformers", "requests")]
    assert heavy == [], heavy


if __name__ == "__main__":  # the graph as the code has it today
    for mod, deps in GRAPH.items():
        print(mod, "->", ", ".join(deps))
