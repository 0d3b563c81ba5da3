"""No module of the package reaches into another's private names.

A name with one leading underscore belongs to its module: another module of ``fastweights`` neither imports it
(``from fastweights.x import _name``) nor reads it off an imported module (``import fastweights.x as m``, then
``m._name``). What two modules share is public and named for what it is. Every file under ``src/fastweights`` is
read as a syntax tree (lazy imports inside functions included); dunder names (``__version__``) are not private.
"""

import ast
from pathlib import Path

from helpers import PACKAGE


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def is_module(dotted: str) -> bool:
    """Whether ``fastweights.a.b`` is a module or package of the source tree (not a name inside one)."""
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def own_module(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def absolute(node: ast.ImportFrom, path: Path) -> str:
    """The module an ``from ... import`` reads, relative imports resolved against ``path``'s package."""
    if not node.level:
        return node.module or ""
    package = own_module(path).split(".") if path.name == "__init__.py" else own_module(path).split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_reaches(path: Path) -> list[str]:
    """``path``'s imports of another fastweights module's private names, and its reads of them off an imported
    module, as ``file:line: what``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = own_module(path)
    modules: set[str] = set()  # local names bound to a fastweights module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = absolute(node, path)
            if not source.startswith("fastweights") or source == own:
                continue
            for alias in node.names:
                if is_private(alias.name):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: imports {alias.name} from {source}")
                elif is_module(f"{source}.{alias.name}"):
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fastweights.") and alias.asname:
                    modules.add(alias.asname)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and is_private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in modules):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: reads {node.value.id}.{node.attr}")
    return found


def test_no_module_imports_a_private_name_of_another():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in private_reaches(path)]
    assert not found, ("private names reached across modules (make the name public, named for what it is, or "
                       "move it to where it is used):\n" + "\n".join(found))


def test_a_private_import_is_caught(tmp_path, monkeypatch):
    """The check sees every form: a module-level and a lazy import, a relative one, and a read off a module."""
    package = tmp_path / "fastweights"
    (package / "adapt").mkdir(parents=True)
    (package / "adapt" / "__init__.py").write_text("")
    (package / "adapt" / "sparse.py").write_text("def _frozen():\n    pass\n")
    bad = package / "adapt" / "lowrank.py"
    bad.write_text("from fastweights.adapt.sparse import _frozen\n"
                   "from fastweights.core.errors import UserError, __version__\n"
                   "def f():\n    from .sparse import _frozen as frozen\n"
                   "import fastweights.adapt.sparse as sparse\n"
                   "from fastweights.adapt import sparse as s\n"
                   "x = sparse._frozen, s._frozen, s.public, UserError._message\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", package)
    found = private_reaches(bad)
    assert [line.split(": ", 1)[1] for line in found] == [
        "imports _frozen from fastweights.adapt.sparse", "imports _frozen from fastweights.adapt.sparse",
        "reads sparse._frozen", "reads s._frozen"]
