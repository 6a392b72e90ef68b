"""The shape of the code: which part may import which, no import circles, and size limits.

Every part of the project has a rank; a module may import its own part and parts of a lower
rank only (imports inside functions count too). A new package or top-level module in
trainer/, or a new package in scripts/, must be given a rank here, so the architecture cannot
change without this file. The modules directly in scripts/ are commands: they import the
packages, never another command.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import pytest

from trainer.config import Float8TrainingConfig

ROOT = Path(__file__).resolve().parents[1]

RANKS = {
    "float8": 0,
    "models": 1,
    "trainer.launch": 2,
    "trainer.errors": 3, "trainer.log": 3, "trainer.records": 3, "trainer.threads": 3, "trainer.host_copies": 3,
    # The float8 seam's config rules: read by trainer.config's checks, importing nothing of the project.
    "trainer.float8_seam.options": 3,
    "trainer.config": 4, "trainer.precision": 4, "trainer.adamw_triton": 4,
    "trainer.data": 5, "trainer.distributed": 5, "trainer.metrics": 5, "trainer.optim": 5,
    "trainer.model_setup": 5, "trainer.run_facts": 5, "trainer.train_state": 5,
    "trainer.loss": 6, "trainer.checkpoint": 6, "trainer.float8_seam": 6,
    "trainer.validation": 7, "trainer.run_folder": 7, "trainer.step": 7, "trainer.plan": 7,
    "trainer.inference": 7,
    "trainer.trainer": 8, "trainer.dry_run": 8,
    "trainer.crash": 9,
    "trainer.cli": 10,
    # scripts/'s packages: what the commands share.
    "scripts.harness": 11, "scripts.corpus": 11,
    # What a user runs: train.py and the commands directly in scripts/ (scripts/__init__.py too).
    "train": 12, "scripts": 12,
}
PROJECT = ("float8", "models", "trainer", "scripts", "train")
MAX_FILE_LINES = 350
MAX_TRAINER_FUNCTION_LINES = 60
MAX_COMMANDS = 16


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str | None:
    """The ranked part a module belongs to: float8, models, train, trainer.<first level>, a module
    deeper in trainer/ that RANKS names on its own, scripts.<package>, or scripts for a command."""
    top = module.split(".")[0]
    if top not in PROJECT or module == "trainer":  # trainer/__init__.py is empty
        return None
    if top == "scripts":
        package = ".".join(module.split(".")[:2])
        return package if module.count(".") > 1 or package in RANKS else "scripts"
    if top == "trainer":
        parts = module.split(".")
        return next((".".join(parts[:n]) for n in range(len(parts), 2, -1) if ".".join(parts[:n]) in RANKS),
                    ".".join(parts[:2]))
    return top


def imports_of(path: Path, module: str) -> set[str]:
    """Project modules imported anywhere in the file (relative imports resolved)."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if part_of(m) is not None}


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports, for every .py file of the project under `root`."""
    files = [root / "train.py", *[p for top in PROJECT[:-1] for p in (root / top).rglob("*.py")]]
    modules = {module_name(p, root): p for p in files if p.exists() and part_of(module_name(p, root))}
    graph = {}
    for name, path in modules.items():
        # `from a.b import c` names module a.b.c when it exists, else the object c of a.b.
        graph[name] = {m for m in imports_of(path, name) if m in modules and m != name}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, targets in graph.items():
        own = part_of(module)
        if own not in RANKS:
            problems.append(f"{module}: part {own} has no rank")
            continue
        for target in sorted(targets):
            part = part_of(target)
            if part == own:
                continue
            if part not in RANKS:
                problems.append(f"{module} imports {target}: part {part} has no rank")
            elif RANKS[part] >= RANKS[own]:
                problems.append(f"{module} (rank {RANKS[own]}) imports {target} (rank {RANKS[part]})")
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles between modules (each reported once, by depth-first search)."""
    found, state = [], {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


@functools.cache
def project_graph() -> dict[str, set[str]]:
    """The repository's import graph, parsed once for the tests that read it."""
    return import_graph(ROOT)


def test_imports_point_down_the_ranks():
    assert upward_imports(project_graph()) == []


def test_no_import_circles():
    assert cycles(project_graph()) == []


def test_every_trainer_part_has_a_rank():
    parts = {part_of(module_name(p, ROOT)) for p in (ROOT / "trainer").rglob("*.py")} - {None}
    assert sorted(parts - RANKS.keys()) == []


def test_float8_and_models_stay_self_contained():
    """float8/ names no trainer path even in comments; models/ has no parallelism."""
    for path in (ROOT / "float8").rglob("*.py"):
        assert "trainer/" not in path.read_text(), path
    for path in (ROOT / "models").rglob("*.py"):
        text = path.read_text()
        for word in ("torch.distributed", "fully_shard", "parallelize_module", "DeviceMesh"):
            assert word not in text, (path, word)


# The float8 seam's public face: what the rest of trainer/ may import of trainer/float8_seam/.
SEAM_ENTRIES = {"trainer.float8_seam.seam", "trainer.float8_seam.options"}


def test_the_rest_of_the_trainer_reaches_float8_through_the_seam():
    """Only trainer/float8_seam/ imports float8/; other trainer modules import the seam's entries only."""
    offenders = []
    for module, targets in project_graph().items():
        if not module.startswith("trainer.") or module.startswith("trainer.float8_seam"):
            continue
        offenders += [f"{module} imports {t}" for t in sorted(targets)
                      if t.split(".")[0] == "float8" or (t.startswith("trainer.float8_seam") and t not in SEAM_ENTRIES)]
    assert offenders == []


def float8_rules_outside_the_seam(root: Path) -> list[str]:
    """Where trainer/ or train.py, outside the seam and the config schema, names a float8 recipe or
    implementation ('tensorwise', 'torchao') or reads a `[float8]` key (`cfg.float8.scaling`): a float8
    rule living outside trainer/float8_seam/. Passing the section on (`build_seam(cfg.float8, ...)`) is fine."""
    # The schema's choices, not float8.RECIPES (the same names: tests/trainer/float8_seam/test_seam.py): no torch here.
    fields = {f.name: f for f in dataclasses.fields(Float8TrainingConfig)}
    names = {*fields["scaling"].metadata["choices"], *fields["impl"].metadata["choices"]}
    files = [root / "train.py", *(root / "trainer").rglob("*.py")]
    found = []
    for path in sorted(p for p in files if p.exists()):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("trainer/float8_seam/") or relative == "trainer/config/schema.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{relative}:{node.lineno} names {node.value!r}")
            elif (isinstance(node, ast.Attribute) and node.attr in fields
                  and isinstance(node.value, ast.Attribute) and node.value.attr == "float8"):
                found.append(f"{relative}:{node.lineno} reads float8.{node.attr}")
    return found


def test_float8_rules_live_in_the_seam():
    assert float8_rules_outside_the_seam(ROOT) == []


def test_float8_rule_finder_finds_a_planted_rule(tmp_path):
    _plant(tmp_path, {
        "trainer/run_facts.py": 'def f(cfg):\n    return cfg.float8.scaling if cfg.float8.impl != "ours" else 0\n',
        "trainer/float8_seam/ours.py": 'RECIPE = "tensorwise"\n',
        "train.py": "",
    })
    assert float8_rules_outside_the_seam(tmp_path) == [
        "trainer/run_facts.py:2 reads float8.scaling", "trainer/run_facts.py:2 reads float8.impl",
        "trainer/run_facts.py:2 names 'ours'",
    ]


def test_file_and_function_sizes():
    big_files = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for top in ("trainer", "float8", "models", "scripts")
        for p in sorted((ROOT / top).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    long_functions = [
        f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for p in sorted((ROOT / "trainer").rglob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_TRAINER_FUNCTION_LINES
    ]
    assert big_files == [] and long_functions == []


def commands_importing_commands(graph: dict[str, set[str]]) -> list[str]:
    """Where a command (a module directly in scripts/) imports another: what two commands share
    belongs in one of scripts/'s packages (or lower)."""
    commands = {m for m in graph if part_of(m) == "scripts" and m != "scripts"}
    return [f"{m} imports {t}" for m in sorted(commands) for t in sorted(graph[m]) if t in commands]


def test_commands_import_packages_never_each_other():
    assert commands_importing_commands(project_graph()) == []


def test_commands_checker_finds_a_planted_import(tmp_path):
    graph = _plant(tmp_path, {
        "scripts/__init__.py": "", "scripts/harness/__init__.py": "", "scripts/harness/cells.py": "",
        "scripts/a.py": "from scripts.harness import cells\nfrom scripts import b\n",
        "scripts/b.py": "from scripts.harness.cells import x\n",
        "scripts/harness/report.py": "from scripts.a import y\n",
    })
    assert commands_importing_commands(graph) == ["scripts.a imports scripts.b"]
    assert upward_imports(graph) == ["scripts.harness.report (rank 11) imports scripts.a (rank 12)"]


def test_scripts_holds_commands():
    """At most MAX_COMMANDS modules directly in scripts/, each a command: a `main` run by trainer.cli's
    run_command (tests/scripts/test_commands.py runs each with --help)."""
    commands = sorted(p for p in (ROOT / "scripts").glob("*.py") if p.name != "__init__.py")
    assert len(commands) <= MAX_COMMANDS, [p.name for p in commands]
    not_commands = [p.name for p in commands if "sys.exit(run_command(main))" not in p.read_text()]
    assert not_commands == []


def sys_path_edits(root: Path) -> list[str]:
    """Where a module changes sys.path (insert, append, assignment): the packages are installed
    (pip install -e .), so nothing needs to."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith((".", "build/")) or "/." in relative:
            continue
        for node in ast.walk(ast.parse(path.read_text(), relative)):
            target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
            targets = node.targets if isinstance(node, ast.Assign) else [target]
            if any(isinstance(x, ast.Attribute) and x.attr == "path" and isinstance(x.value, ast.Name)
                   and x.value.id == "sys" for x in targets):
                found.append(f"{relative}:{node.lineno}")
    return found


def test_no_sys_path_edits():
    assert sys_path_edits(ROOT) == []


def test_sys_path_finder_finds_a_planted_edit(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "a.py").write_text("import sys\nsys.path.insert(0, '.')\nprint(sys.path[0])\n")
    (tmp_path / "b.py").write_text("import sys\nsys.path = []\n")
    assert sys_path_edits(tmp_path) == ["b.py:2", "scripts/a.py:2"]


def test_no_script_imports_another_scripts_private_names():
    offenders = []
    for path in (ROOT / "scripts").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("scripts"):
                offenders += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert offenders == []


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(tmp_path)


@pytest.mark.parametrize("planted, expected", [
    ({"float8/a.py": "from trainer.log import info\n", "trainer/log.py": ""},
     "float8.a (rank 0) imports trainer.log (rank 3)"),
    ({"trainer/config/x.py": "def f():\n    from trainer.data import loader\n", "trainer/data/loader.py": ""},
     "trainer.config.x (rank 4) imports trainer.data.loader (rank 5)"),
    ({"trainer/newpart.py": ""}, "trainer.newpart: part trainer.newpart has no rank"),
])
def test_checker_finds_a_planted_upward_import(tmp_path, planted, expected):
    assert upward_imports(_plant(tmp_path, planted)) == [expected]


def test_checker_finds_a_planted_circle(tmp_path):
    graph = _plant(tmp_path, {
        "trainer/data/a.py": "from trainer.data.b import x\n",
        "trainer/data/b.py": "from .a import y\n",
    })
    assert cycles(graph) == [["trainer.data.a", "trainer.data.b", "trainer.data.a"]]
