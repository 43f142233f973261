"""The package's tree for docs/architecture.md, generated from the package itself: each room (folder) and module in
the order of the page's layer table, with the first sentence of its docstring (cut at a clause where it is long).

    .venv/bin/python -m scripts.architecture_tree            # print the tree
    .venv/bin/python -m scripts.architecture_tree --write    # put it between the page's markers

tests/test_docs.py regenerates it and fails where the page's copy differs, so the tree cannot drift from the code:
a new, moved or renamed module, or a changed first sentence, is a `--write` away.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gpt2onnx"
PAGE = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- the package's tree: python -m scripts.architecture_tree --write (tests/test_docs.py checks it) -->"
END = "<!-- end of the package's tree -->"
TABLE_HEADER = "| layer | folder | may import | needs torch |"
NAME_WIDTH = 27  # the column the summaries start at
WIDTH = 118
LONGEST = 130  # a first sentence longer than this is cut at a clause


def layer_order(page: Path = PAGE) -> list[str]:
    """The folders and top-level modules of the package in the order of the page's layer table (top layer first)."""
    text = page.read_text()
    rows = text[text.index(TABLE_HEADER) :].splitlines()[2:]
    order = []
    for row in rows:
        if not row.startswith("|"):
            break
        folders = row.strip().strip("|").split("|")[1]
        order += [part.strip().strip("`").rstrip("/") for part in folders.split(",")]
    return order


def plain(text: str) -> str:
    """Docstring markup made plain: Sphinx roles and double backquotes become Markdown's single ones."""
    text = re.sub(r":\w+:`~?(?:[^`<]*<)?([^`>]+)>?`", lambda m: f"`{m.group(1).split('.')[-1]}`", text)
    return text.replace("``", "`")


def clause_cut(sentence: str, longest: int = LONGEST) -> str:
    """The sentence, or where it is longer than ``longest``, its longest start that ends at a clause outside any
    brackets (before ': ', '; ', ', ', ' (' or ' →'), with '…'."""
    if len(sentence) <= longest:
        return sentence
    depth, cuts, ticks = 0, [], 0
    for i, char in enumerate(sentence[:longest]):
        ticks += char == "`"
        depth += (char in "([") - (char in ")]")
        if depth == 0 and ticks % 2 == 0 and i > 0 and sentence[i : i + 2] in (": ", "; ", ", ", " (", " →"):
            cuts.append(i)
    end = cuts[-1] if cuts else sentence.rfind(" ", 0, longest)
    return sentence[:end].rstrip(" ,;:") + " …"


def summary(path: Path) -> str:
    """The first sentence of a module's docstring (its first paragraph's, as plain text), or a note that it has none."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    if not paragraph:
        return "(no docstring)"
    sentence = re.split(r"(?<=[.!?])\s+(?=[A-Z`(:])", plain(paragraph))[0]
    return clause_cut(sentence.rstrip("."))


def entry(indent: int, name: str, text: str) -> list[str]:
    head = " " * indent + name
    if len(head) >= NAME_WIDTH - 1:  # a long name: its summary on the next line
        return [head, *textwrap.wrap(text, WIDTH, initial_indent=" " * NAME_WIDTH, subsequent_indent=" " * NAME_WIDTH)]
    lines = textwrap.wrap(text, WIDTH - NAME_WIDTH, break_on_hyphens=False)
    return [head.ljust(NAME_WIDTH) + lines[0], *(" " * NAME_WIDTH + line for line in lines[1:])]


def room(folder: Path, indent: int) -> list[str]:
    """A folder's line (its __init__'s summary), then its modules, then its sub-rooms, each sorted by name."""
    init = folder / "__init__.py"
    if init.exists():
        lines = entry(indent, folder.name + "/", summary(init))
    else:  # files the package ships, not Python (a page a target writes)
        files = sorted(p.name for p in folder.iterdir() if p.is_file())
        return entry(indent, folder.name + "/", "files: " + ", ".join(files))
    for module in sorted(folder.glob("*.py")):
        if module.name != "__init__.py":
            lines += entry(indent + 2, module.name, summary(module))
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"):
        lines += room(sub, indent + 2)
    return lines


def tree(package: Path = PACKAGE, page: Path = PAGE) -> str:
    """The package's tree as the page shows it: __init__ and __main__, then the rooms and top-level modules in the
    layer table's order (any the table does not name yet, after them, by name)."""
    lines = ["gpt2onnx/"]
    for name in ("__init__.py", "__main__.py"):
        lines += entry(2, name, summary(package / name))
    rooms = [p.name for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"]
    present = rooms + [p.stem for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    order = [n for n in layer_order(page) if n in present] + sorted(set(present) - set(layer_order(page)))
    for name in order:
        path = package / name
        lines += room(path, 2) if path.is_dir() else entry(2, f"{name}.py", summary(path.with_suffix(".py")))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def with_tree(page_text: str, text: str) -> str:
    """The page with ``text`` between its markers, in a plain code block."""
    start, end = page_text.index(BEGIN) + len(BEGIN), page_text.index(END)
    return page_text[:start] + "\n```\n" + text + "```\n" + page_text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the tree into docs/architecture.md")
    args = parser.parse_args(argv)
    text = tree()
    if args.write:
        PAGE.write_text(with_tree(PAGE.read_text(), text))
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
