"""FORKING.md names real things: every file it names exists, every `module.name` it names is defined
at the top of that module, and the README sends readers to it.

Run: python -m pytest -q tests/test_forking.py      (~1 s; parses the files, imports nothing)

Why: FORKING.md's "where to edit" table is what a forker trusts first; a function renamed without
the table following it sends them to a place that is not there.
"""
from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A module as FORKING.md names it: a top-level file (`grpo.x`), a plumbing/ file by its own name
# (`rundir.x`, as the trainers import it), or the vm package (`vm.FILES`).
PATHS = {f[:-3]: f for f in os.listdir(ROOT) if f.endswith(".py")}
PATHS.update({f[:-3]: os.path.join("plumbing", f) for f in os.listdir(os.path.join(ROOT, "plumbing"))
              if f.endswith(".py") and f != "__init__.py"})
PATHS["vm"] = os.path.join("vm", "__init__.py")
OURS = set(PATHS)
NOT_OURS = {"args.json", "config.json"}  # files a run folder or a checkpoint holds, not the repository


def forking() -> str:
    with open(os.path.join(ROOT, "FORKING.md"), encoding="utf-8") as f:
        return f.read()


def top_level_names(mod: str) -> set[str]:
    with open(os.path.join(ROOT, PATHS[mod]), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_file_forking_md_names_exists():
    files = set(re.findall(r"\b([\w/]+\.(?:py|md|sh|json))\b", forking()))
    missing = [f for f in sorted(files) if f not in NOT_OURS and not os.path.exists(os.path.join(ROOT, f))
               and not os.path.exists(os.path.join(ROOT, "tests", f))]
    assert not missing, f"FORKING.md names files that do not exist: {missing}"
    assert len(files) > 20  # the parse found the table, not nothing


def test_every_module_name_forking_md_names_is_defined_there():
    found = set(re.findall(r"\b([a-z_]+)\.([A-Za-z_]\w*)\b", forking()))
    pairs = [(m, n) for m, n in found if m in OURS and n not in ("py", "md")]
    missing = [f"{m}.{n}" for m, n in sorted(pairs) if n not in top_level_names(m)]
    assert not missing, f"FORKING.md names what its module does not define: {missing}"
    assert len(pairs) > 15


def test_the_readme_points_to_forking_md():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "FORKING.md" in f.read()


def test_every_file_the_readme_and_docs_name_exists():
    # the README and docs/ send a newcomer to files; none of them may be a file that moved or went
    docs = sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    assert len(docs) >= 5  # docs/ holds pictures too (explore_curves.png), read only the text
    for doc in ["README.md"] + docs:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            files = set(re.findall(r"\b([\w/.-]+\.(?:py|md|sh))\b", f.read()))
        missing = [f for f in sorted(files) if not any(os.path.exists(os.path.join(ROOT, base, f))
                                                       for base in ("", "docs", "tests", "bench"))]
        assert not missing, f"{doc} names files that do not exist: {missing}"

