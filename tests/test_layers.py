"""The import layers (imports point down only), read off the source.

Run: python -m pytest -q tests/test_layers.py      (~1 s; parses the files, imports nothing)

Every top-level .py of the project is parsed with ast; every import of one of our own modules,
at the top or inside a function, is an edge. Then: no cycle; nothing imports vm_server.py (it is
the program a VM runs) or a trainer (train_*.py are the tops: nothing imports them, and they take
plain values, never each other's Args); each trainer's own files sit right below it and apart
from the other's:

    train_arpo.py     -> arpo_eval.py (evaluation, task selection) -> arpo_episode.py (one episode)
                      -> arpo_replay.py (the replay buffer of successes)
                      -> arpo_log.py (the metrics line, the console line)
    train_explore.py  -> explore_eval.py (exploration eval) -> explore_episode.py (one episode)
                      -> explore_distill.py (the distillation data)
                      -> explore_log.py (the metrics line, the console line, trajectories)
    both              -> rollout.py, plumbing/rundir.py, grpo.py, model.py, ... (rewards.py -> rewards.py:
                         ScreenExplorer's)

rollout.py, the stepper both trainers play episodes with, sits below both and knows no model (no
torch: generation is the caller's policy_fn); the bottoms (actions.py, vm/procs.py, qwen_vl.py) import
nothing of ours, and chat.py nothing but qwen_vl.py (the model family's tokens and chat format);
qwen_vl.py and plumbing/warm_start.py sit below model.py, and the model side reaches nothing of the VM side;
no `from X import _name` across our files; no module `__getattr__`; no `sys.modules` assignment or
setdefault.

The graph itself: `python -c "import sys; sys.path[:0] = ['tests', '.']; import test_layers as L;
[print(m, '->', ', '.join(d)) for m, d in L.GRAPH.items()]"`.
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


OWN = {"train_arpo": ["arpo_episode", "arpo_eval", "arpo_log", "arpo_replay"],
       "train_explore": ["explore_distill", "explore_episode", "explore_eval", "explore_log"]}


def test_each_trainers_own_files_are_below_it_and_apart_from_the_other():
    assert sorted(m for ms in OWN.values() for m in ms) == sorted(m for m in OURS if m.startswith(("arpo_", "explore_")))
    for trainer, mine in OWN.items():
        theirs = [m for t, ms in OWN.items() if t != trainer for m in [t, *ms]]
        assert set(mine) <= set(GRAPH[trainer]), (trainer, GRAPH[trainer])
        for mod in mine:
            assert not set(GRAPH[mod]) & set(theirs), (mod, GRAPH[mod])  # nothing of the other trainer's
            assert set(GRAPH[mod]) <= set(mine) | set(OURS) - set(theirs) - {trainer}


def test_rollout_is_below_both_trainers_and_knows_no_model():
    assert all("rollout" in GRAPH[t] for t in ("train_arpo", "train_explore"))
    assert set(GRAPH["rollout"]) <= {"env", "plumbing.progress", "actions", "vm.tasks"}, GRAPH["rollout"]
    names = [a.name for node in ast.walk(tree("rollout")) if isinstance(node, ast.Import) for a in node.names]
    names += [node.module for node in ast.walk(tree("rollout")) if isinstance(node, ast.ImportFrom) and node.module]
    assert names and not [n for n in names if n.split(".")[0] in ("torch", "transformers")], names


def test_bottoms_import_nothing_of_ours():
    for mod in ("actions", "vm.procs", "qwen_vl"):
        assert GRAPH[mod] == [], f"{mod}.py imports {GRAPH[mod]}"
    assert GRAPH["chat"] == ["qwen_vl"], f"chat.py imports {GRAPH['chat']}"


def test_the_model_family_lives_below_the_model():
    # qwen_vl.py (what is specific to the family) and plumbing/warm_start.py (the tiny warm-started models)
    # sit below model.py, and nothing of the model side reaches the VM side.
    assert {"qwen_vl", "plumbing.warm_start"} <= set(GRAPH["model"]) and "model" not in GRAPH["plumbing.warm_start"]
    vm_side = {"vm_server", "env"} | {m for m in OURS if m.startswith("vm.")}
    for mod in ("qwen_vl", "chat", "plumbing.warm_start", "model", "grpo"):
        assert not vm_side & set(GRAPH[mod]), f"{mod}.py imports {sorted(vm_side & set(GRAPH[mod]))}"


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
