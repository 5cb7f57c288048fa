"""Code lines of Python folders at a commit: no blank lines, comments or docstrings (issue 32's measure).

    python3 scripts/sloc.py COMMIT engine backends
"""

import ast
import io
import subprocess
import sys
import tokenize

_SKIP = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
         tokenize.ENDMARKER)


def code_lines(src: str) -> int:
    """Lines holding a token that is neither a comment nor part of a module/class/function docstring."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return 0
    doc = set()
    for n in ast.walk(tree):
        body = getattr(n, "body", None)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                doc.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in _SKIP:
            lines.update(x for x in range(tok.start[0], tok.end[0] + 1) if x not in doc)
    return len(lines)


def main() -> None:
    commit, folders = sys.argv[1], sys.argv[2:]
    for folder in folders:
        names = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit, folder], check=True,
                               capture_output=True, text=True).stdout.split()
        show = [subprocess.run(["git", "show", f"{commit}:{f}"], check=True, capture_output=True, text=True)
                for f in names if f.endswith(".py")]
        total = sum(code_lines(r.stdout) for r in show)
        print(f"{commit} {folder} {total}")


if __name__ == "__main__":
    main()
