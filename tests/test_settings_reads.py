"""No production module reads a `TRAINYARD_*` variable but the settings module (`common.settings`).

The scan fails naming file:line for a read of a `TRAINYARD_*` variable anywhere in the
production packages but `common/settings.py`: `os.environ.get(...)`, `os.getenv(...)`,
`env[...]`, `env.get(...)`, `... in env`, `env.setdefault(...)`, a `pop` whose value is used,
by the variable's name, by a constant holding it, or by a loop over names. Writing a
variable for a child process (`env[NAME] = value`) and removing one are not reads.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from common.settings import PREFIX

ROOT = Path(__file__).resolve().parent.parent
PRODUCTION = ("assets", "resources", "instance", "pipelines", "trainyard", "training", "common", "featurestore")
SETTINGS_MODULE = ROOT / "common" / "settings.py"
# Reads that stay outside the settings module, each with its reason.
EXEMPT = {
    # Redaction reads the URL variables' values only to hide their passwords in a message: it runs in error paths,
    # so it must never raise on another variable's bad value (which `settings()` would).
    "trainyard/redact.py",
}


def _holds_name(node: ast.AST) -> bool:
    """A literal `TRAINYARD_*` string, or a tuple/list holding one at any depth."""
    return any(
        isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and n.value.startswith(PREFIX)
        and len(n.value) > len(PREFIX)
        for n in ast.walk(node)
    )


def _constants(paths: list[Path]) -> set[str]:
    """Module-level names bound to a `TRAINYARD_*` name (or a tuple of them) anywhere in the production packages."""
    found = set()
    for path in paths:
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _holds_name(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found |= {t.id for t in targets if isinstance(t, ast.Name)}
    return found


def _loop_names(target: ast.AST, iterable: ast.AST, constants: set[str]) -> set[str]:
    """The loop variables that take a `TRAINYARD_*` name: `for var in (...)`, or the matching place of `for var, field
    in ((...), ...)`."""
    if isinstance(iterable, ast.Name) and iterable.id in constants and isinstance(target, ast.Name):
        return {target.id}
    if not isinstance(iterable, (ast.Tuple, ast.List)):
        return set()
    if isinstance(target, ast.Name):
        return {target.id} if _holds_name(iterable) else set()
    if isinstance(target, ast.Tuple):
        return {t.id for i, t in enumerate(target.elts) if isinstance(t, ast.Name)
                and any(isinstance(e, ast.Tuple) and len(e.elts) > i and _holds_name(e.elts[i]) for e in iterable.elts)}
    return set()


def reads_outside_settings() -> list[str]:
    """'path:line: code' for every read of a `TRAINYARD_*` variable in the production packages but
    `common/settings.py`."""
    paths = sorted(p for package in PRODUCTION for p in (ROOT / package).rglob("*.py") if p != SETTINGS_MODULE)
    constants = _constants(paths)
    found = []
    for path in paths:
        relative = path.relative_to(ROOT).as_posix()
        if relative in EXEMPT:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        looped = {name for node in ast.walk(tree) if isinstance(node, (ast.For, ast.comprehension))
                  for name in _loop_names(node.target, node.iter, constants)}

        def names_variable(key: ast.AST, looped: set[str] = looped) -> bool:
            if isinstance(key, ast.Constant):
                return isinstance(key.value, str) and key.value.startswith(PREFIX)
            if isinstance(key, ast.Name):
                return key.id in constants or key.id in looped
            if isinstance(key, ast.Attribute):
                return key.attr in constants
            if isinstance(key, ast.JoinedStr):  # f"TRAINYARD_{...}"
                return any(isinstance(v, ast.Constant) and str(v.value).startswith(PREFIX) for v in key.values[:1])
            return False

        discarded = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            read = None
            if isinstance(node, ast.Call) and node.args and names_variable(node.args[0]):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in ("get", "getenv", "setdefault") or (name == "pop" and id(node) not in discarded):
                    read = node
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and names_variable(node.slice):
                read = node
            elif (
                isinstance(node, ast.Compare)
                and names_variable(node.left)
                and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
            ):
                read = node
            if read is not None:
                found.append(f"{relative}:{read.lineno}: {ast.unparse(read)}")
    return sorted(found)


def test_no_production_module_reads_a_trainyard_variable_but_the_settings_module() -> None:
    found = reads_outside_settings()
    assert not found, "read these through common.settings.settings() instead:\n" + "\n".join(found)


def test_the_scan_finds_each_form_of_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan is not vacuous: a module with every form of read (and two writes) is reported read by read."""
    package = tmp_path / "training"
    package.mkdir()
    (package / "bad.py").write_text(
        "import os\n"
        "HOME_ENV = 'TRAINYARD_HOME'\n"
        "a = os.environ.get('TRAINYARD_ENV')\n"
        "b = os.getenv(HOME_ENV)\n"
        "c = os.environ['TRAINYARD_USER']\n"
        "d = 'TRAINYARD_USER' in os.environ\n"
        "for var in ('TRAINYARD_K8S_STUCK_SECONDS', 'TRAINYARD_K8S_QUEUE'):\n"
        "    e = os.environ.get(var)\n"
        "f = os.environ.pop(HOME_ENV, '')\n"
        "os.environ.pop(HOME_ENV, None)\n"
        "os.environ['TRAINYARD_LAUNCH_ID'] = 'x'\n"
    )
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "SETTINGS_MODULE", tmp_path / "common" / "settings.py")
    lines = sorted(int(f.split(":")[1]) for f in reads_outside_settings())
    assert lines == [3, 4, 5, 6, 8, 9]


