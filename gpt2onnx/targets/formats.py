"""One escaping rule per format a target writes: every value a target puts into a config, a script or a page
goes through the writer of that file's format here, never through an f-string of its own.

- protobuf text format (Triton's ``config.pbtxt``): :func:`pbtxt_string`
- YAML (KServe's manifest): :func:`yaml_string`, and :func:`yaml_comment` for text in a comment
- JSON files: :func:`json_text`
- JSON inlined in an HTML ``<script>`` block: :func:`script_json`; HTML text: :func:`html_text`
"""

from __future__ import annotations

import html
import json

# protobuf's text format: C-style escapes (google/protobuf/text_format.py CEscape); every other byte below 0x20
# and 0x7f as three octal digits, so nothing a value holds can end its string or start a line
_PBTXT_ESCAPES = {"\\": "\\\\", '"': '\\"', "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def pbtxt_string(value: str) -> str:
    """``value`` as a quoted protobuf text-format string (its UTF-8 bytes, escaped)."""
    out = []
    for char in str(value):
        if char in _PBTXT_ESCAPES:
            out.append(_PBTXT_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\{ord(char):03o}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def yaml_string(value: str) -> str:
    """``value`` as a YAML double-quoted scalar: JSON's string escapes are YAML's, and ASCII-only output leaves no
    character (a line separator, a BOM) that a YAML reader treats as a line break or refuses."""
    return json.dumps(str(value), ensure_ascii=True)


def yaml_comment(value: str) -> str:
    """``value`` for the text of a ``#`` comment: one line, printable ASCII (anything else as its JSON escape)."""
    return json.dumps(str(value), ensure_ascii=True)[1:-1]


def json_text(value) -> str:
    """A JSON file's text (indented, newline at the end; NaN and infinity refused: they are not JSON)."""
    return json.dumps(value, indent=2, allow_nan=False) + "\n"


def script_json(value) -> str:
    """JSON data for a ``<script type="application/json">`` block: every '<', '>' and '&' and the two line
    separators JavaScript reads as line ends written as escapes, so no '</script>' or '<!--' ends it early."""
    text = json.dumps(value, indent=2, allow_nan=False)
    for char in "<>&\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text


def html_text(value: str) -> str:
    """``value`` as HTML text (and attribute-safe: quotes escaped)."""
    return html.escape(str(value), quote=True)
