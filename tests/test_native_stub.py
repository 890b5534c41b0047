"""The extension's .pyi stub names exactly what the extension defines."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from datadist_aio import _native

STUB = Path(__file__).resolve().parent.parent / "datadist_aio" / "_native.pyi"


def _stub_names() -> dict[str, set[str]]:
    tree = ast.parse(STUB.read_text())
    names: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[""].add(node.name)
            names[node.name] = {
                item.name for item in node.body if isinstance(item, ast.FunctionDef) and item.name != "__init__"
            }
        elif isinstance(node, ast.FunctionDef):
            names[""].add(node.name)
    return names


def _public(obj: object) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def test_stub_matches_extension():
    stub = _stub_names()
    module = {name for name in _public(_native) if inspect.isclass(getattr(_native, name)) or callable(getattr(_native, name))}
    assert stub[""] == module
    for name in stub[""]:
        obj = getattr(_native, name)
        if inspect.isclass(obj):
            assert stub[name] == _public(obj), name
