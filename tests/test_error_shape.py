"""One builder of OpenAI-shaped errors: skymesh/edge/openai_errors.py. The source of
skymesh/ and controller/ is scanned for the shape built anywhere else, so a sixth way of
writing ``{"error": {...}}`` fails here. The stand-in replica builds vLLM's own error
shape on purpose (skymesh/replica_sim/) and is the one exception."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILDER = ROOT / "skymesh" / "edge" / "openai_errors.py"
STAND_IN = ROOT / "skymesh" / "replica_sim"
# the fields of the inner error object, any three of which make a dict literal one
INNER_FIELDS = frozenset({"message", "type", "param", "code"})


def _keys(node: ast.Dict) -> set[str]:
    return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def _value_of(node: ast.Dict, key: str) -> ast.expr | None:
    for k, v in zip(node.keys, node.values, strict=True):
        if isinstance(k, ast.Constant) and k.value == key:
            return v
    return None


def _callee_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def error_shapes(source: str) -> list[int]:
    """Lines of ``source`` that build an error body by hand: a dict literal
    ``{"error": {...}}``, one holding three of the inner fields (or ``dict(...)`` of them,
    or of ``error=``), or a
    ``json_response`` of a dict literal with an "error" key (whatever its value)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            inner = _value_of(node, "error")
            if isinstance(inner, ast.Dict) or len(_keys(node) & INNER_FIELDS) >= 3:
                lines.append(node.lineno)
        elif isinstance(node, ast.Call):
            name = _callee_name(node)
            keywords = {kw.arg for kw in node.keywords}
            if name == "dict" and ("error" in keywords or len(keywords & INNER_FIELDS) >= 3):
                lines.append(node.lineno)
            elif name == "json_response":
                data = node.args[0] if node.args else next(
                    (kw.value for kw in node.keywords if kw.arg == "data"), None)
                if isinstance(data, ast.Dict) and "error" in _keys(data):
                    lines.append(node.lineno)
    return sorted(set(lines))


def _sources() -> list[Path]:
    return sorted([*(ROOT / "skymesh").rglob("*.py"), *(ROOT / "controller").rglob("*.py")])


def test_only_the_builder_writes_the_openai_error_shape() -> None:
    elsewhere = {}
    for path in _sources():
        if path == BUILDER or STAND_IN in path.parents:
            continue
        found = error_shapes(path.read_text())
        if found:
            elsewhere[str(path.relative_to(ROOT))] = found
    assert elsewhere == {}, f"OpenAI-shaped errors built outside {BUILDER.name}: {elsewhere}"


def test_the_scan_finds_the_builder_and_the_stand_in() -> None:
    # the scan is not vacuous: it sees the one builder and vLLM's shape in the stand-in
    assert error_shapes(BUILDER.read_text())
    assert any(error_shapes(p.read_text()) for p in STAND_IN.rglob("*.py"))


def test_the_scan_finds_each_way_of_writing_the_shape() -> None:
    ways = {
        "nested": 'body = {"error": {"message": m, "type": t, "param": None, "code": c}}',
        "inner apart": 'inner = {"message": m, "type": "x", "code": c}\nbody = {"error": inner}',
        "dict call": "body = dict(error=e)",
        "inner dict call": 'body = {"error": dict(message=m, type=t, code=c)}',
        "flat json": 'r = web.json_response({"error": "bad token"}, status=401)',
        "flat json data=": 'r = web.json_response(data={"error": "no"}, status=400)',
    }
    for what, source in ways.items():
        assert error_shapes(source), what
    # what is no error body: log extras, a status document with an error field
    assert error_shapes('log.warning("x", extra={"error": repr(e)})\nd = {"result": r, "error": s}') == []
