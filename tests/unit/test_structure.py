"""The code's shape, as docs/ARCHITECTURE.md promises it: small modules and functions, peer states
and gRPC statuses decided by types (never by comparing strings), every package in the layer contract
(which `lint-imports` checks in the test command)."""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SWARM = ROOT / "swarm"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# argument parsers are long lists of options, not logic
PARSER_FUNCTIONS = {"add_sim_parser"}
PEER_STATE_WORDS = {"joining", "online", "draining", "offline"}
EXCEPTION_NAMES = {"e", "exc", "err", "error"}


def _modules():
    return [p for p in sorted(SWARM.rglob("*.py")) if "generated" not in p.parts]


def test_no_module_over_400_lines():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules()}
    long = {path: n for path, n in lines.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_60_lines():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name not in PARSER_FUNCTIONS:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def _string_constants(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_string_constants(e) for e in node.elts)) if node.elts else set()
    return set()


def test_no_string_comparison_decides_a_peer_state():
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                words = _string_constants(node.left).union(*(_string_constants(c) for c in node.comparators))
                if words & PEER_STATE_WORDS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"compare PeerState members, not strings: {found}"


def test_no_string_matching_on_error_messages():
    """`"..." in str(e)` decided a gRPC status once (and mapped a stopped executor to
    INVALID_ARGUMENT): statuses come from error types now."""
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
                for right in node.comparators:
                    if isinstance(right, ast.Call) and getattr(right.func, "id", None) == "str" and right.args:
                        if getattr(right.args[0], "id", None) in EXCEPTION_NAMES:
                            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_layer_contract_covers_every_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")
    named = {name.strip() for layer in layers["layers"] for name in layer.split("|")}
    top = {p.stem for p in SWARM.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in SWARM.iterdir() if p.is_dir() and (p / "__init__.py").exists()
    }
    assert top == named, f"not in the layer contract: {top - named}; listed but missing: {named - top}"
    assert layers.get("exhaustive") is True


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_says_what_it_owns(path):
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), f"{path.relative_to(ROOT)} has no module docstring"
