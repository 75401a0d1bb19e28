"""Tripwires, not targets: no function of the package over 100 lines of code (docstrings,
comments and blank lines excluded), no module of it over 700 lines, and ``time.sleep`` in
the tests only where it stands for a slow or stuck process (the tiny workers, the rank-side
Gloo stand-in, the outage set-ups, the sweep loop's slow trials) or paces the one polling
helper (``services.wait_until``).

Run: ``python scripts/bars.py`` (``make lint`` and ``make test`` run it); exits 1 naming
every place over a bar.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

# far above today's files: code splits where its meaning splits (docs/development.md), and
# only a file that has clearly outgrown one concern trips these
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 700
# test files whose sleeps stand for a slow or stuck process (test_sweep_loop: trials that
# outlast fmin's poll), or pace the polling helper
SLEEP_ALLOWED = {"workers.py", "gloo_rendezvous.py", "services.py", "test_faults.py",
                 "test_sweep_loop.py"}
ROOT = Path(__file__).resolve().parent.parent


def code_lines(source: str, node: ast.AST) -> int:
    """Lines of ``node`` that hold code: not blank, not only a comment, not a docstring."""
    first, last = node.lineno, node.end_lineno or node.lineno  # type: ignore[attr-defined]
    skip: set[int] = set()
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if (isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            doc = body[0]
            skip.update(range(doc.lineno, (doc.end_lineno or doc.lineno) + 1))
    holding: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        for line in range(tok.start[0], tok.end[0] + 1):
            if first <= line <= last:
                holding.add(line)
    return len(holding - skip)


def check_file(path: Path) -> list[str]:
    source = path.read_text()
    rel = path.relative_to(ROOT)
    problems = []
    lines = source.count("\n")
    if lines > MAX_MODULE_LINES:
        problems.append(f"{rel}: {lines} lines (bar: {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = code_lines(source, node)
            if n > MAX_FUNCTION_LINES:
                problems.append(f"{rel}:{node.lineno}: {node.name}() has {n} lines of code "
                                f"(bar: {MAX_FUNCTION_LINES})")
    return problems


def sleeps_in_tests() -> list[str]:
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name in SLEEP_ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "time.sleep" in line:
                found.append(f"{path.relative_to(ROOT)}:{number}: time.sleep in a test")
    return found


def main() -> int:
    problems: list[str] = []
    for path in sorted((ROOT / "mlflow_hvd").rglob("*.py")):
        problems.extend(check_file(path))
    problems.extend(sleeps_in_tests())
    for problem in problems:
        print(problem)
    print(f"bars: {len(problems)} over")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
