"""No method is named in the core: a method lives in its folder under ``methods/`` and in its registry entry.

The product packages (storage, profiling, edge_client, export, coordinator) run every method
through the registry and the hooks, so a method's name in them is a branch on that method or
knowledge of it that belongs in its folder. Every Python token is read: identifiers, string
literals, comments and docstrings. A name counts as a word or as part of an identifier
(``fed2_groups``, ``FedMA``, ``PanSettings``, ``sphere_seed``), in any case; ``span``,
``expand`` or ``pandas`` do not. The registry (``edge_client/registry.py``) names every method
by design, and docs/ are prose about them.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("storage", "profiling", "edge_client", "export", "coordinator")
ALLOWED = {"edge_client/registry.py"}   # the one place that names every method

# A method's name: not glued to a letter on its left (a camelCase start is a boundary) nor to a
# lower-case letter on its right (``FFCStats``, ``Fed2Plan``: a capital starts the next part).
NAMES = ("spherefed", "sphere", "fedma", "fed2", "dfl", "pans", "pan", "ffc", "fedadam", "fedyogi", "fedadagrad",
         "fedavgm")
PATTERN = re.compile(rf"(?:(?<![A-Za-z])|(?<=[a-z])(?=[A-Z]))(?i:{'|'.join(NAMES)})(?![a-z])")

# Files whose comments or docstrings may still name a method while they are being reworded, each with
# the reason; identifiers and string literals are checked in them all the same. None now.
PROSE_PENDING: set[str] = set()


def _docstring_lines(source: str) -> set[int]:
    """First lines of the docstrings of the module, its classes and its functions."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.add(first.lineno)
    return lines


def mentions(source: str) -> list[tuple[int, str, str]]:
    """(line, kind, name) for every method name in ``source``; kind is code (an identifier or string
    literal) or prose (a comment or docstring)."""
    docstrings = _docstring_lines(source)
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            kind = "prose"
        elif token.type == tokenize.STRING:
            kind = "prose" if token.start[0] in docstrings else "code"
        elif token.type in (tokenize.NAME, getattr(tokenize, "FSTRING_MIDDLE", -1)):
            kind = "code"
        else:
            continue
        for match in PATTERN.finditer(token.string):
            line = token.start[0] + token.string.count("\n", 0, match.start())
            found.append((line, kind, match.group()))
    return found


def _product_files() -> list[Path]:
    return sorted(p for package in PRODUCT for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", _product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_names_no_method(path):
    name = str(path.relative_to(ROOT))
    if name in ALLOWED:
        return
    found = [(line, kind, word) for line, kind, word in mentions(path.read_text(encoding="utf-8"))
             if kind == "code" or name not in PROSE_PENDING]
    assert not found, "\n".join(f"{name}:{line}: {word!r} ({kind}); move it to the method's folder under "
                                "methods/ or reword it generically" for line, kind, word in found)


def test_the_exemptions_are_still_needed():
    """An exemption whose file no longer names a method in its prose is dropped, so it cannot hide a new one
    (a file being split out of another may not exist yet in every checkout)."""
    stale = [name for name in PROSE_PENDING if (ROOT / name).is_file()
             and not any(kind == "prose" for _, kind, _ in mentions((ROOT / name).read_text(encoding="utf-8")))]
    assert stale == []


@pytest.mark.parametrize(("text", "words"), [
    ("fed2_groups = 1", ["fed2"]), ("class Fed2Plan: pass", ["Fed2"]), ("FedMA", ["FedMA"]),
    ("x = PanSettings()", ["Pan"]), ("# PANs fold", ["PANs"]), ("sphere_seed = 0", ["sphere"]),
    ("FFCStats = 1", ["FFC"]), ("usePans = 1", ["Pans"]), ("'dfl_state.safetensors'", ["dfl"]),
    ("'fed2-depth'", ["fed2"]), ("import spherefed", ["spherefed"]),
    ("span = expand = pandas = company = hypersphere = 1", []), ("'panel'", []),
])
def test_the_pattern_finds_names_as_words_and_identifier_parts(text, words):
    assert [word for _, _, word in mentions(text + "\n")] == words
