"""A model folder's chat template (``chat_template`` in its tokenizer_config.json), rendered as transformers renders
it (``messages``, ``add_generation_prompt=True``, the special tokens as variables, ``raise_exception``,
``strftime_now``, the ``tojson`` filter, trim_blocks and lstrip_blocks, loop controls), in jinja2's
``ImmutableSandboxedEnvironment``: the template comes from a folder, so nothing in it may run code, read files or
hold the server.

What is checked, and where:
- when the folder is opened (BadInput, one line): the template's size (at most ``MAX_TEMPLATE_BYTES``), its
  syntax, and that it holds no ``include``, ``import``, ``extends`` (there is no loader: it reads no file) and no
  attribute or key starting with ``_`` (the way out of a sandbox begins with ``__class__``);
- while it renders (ApiError 400): the sandbox's own checks (no unsafe attribute or call, no mutation); a time
  limit (``RENDER_SECONDS``, checked on every line the template runs and every call it makes, by a trace function
  on the rendering thread); and a size limit (:mod:`.sandbox`'s ``MAX_RENDER_CHARS``) on its output and on every
  value it builds where a single operation could allocate much: ``* ** + % ~``, block ``set``, the filters kept
  (those that only read, format or bound their output; ``format``, ``pprint``, ``random``, ``urlize``,
  ``xmlattr``, ``lipsum`` are gone) and the calls of string methods (``format`` and ``expandtabs`` refused).
  Integer arguments to calls and filters are at most that size.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from gpt2onnx.artifact.folder import read_json_file
from gpt2onnx.artifact.paths import file_in_folder
from gpt2onnx.artifact.tokenizer import TOKENIZER_CONFIG
from gpt2onnx.errors import BadInput
from gpt2onnx.serving.openai.protocol import ApiError

MAX_TEMPLATE_BYTES = 64 << 10  # a template larger than this is refused when the folder is opened
RENDER_SECONDS = 1.0  # a template rendering longer is stopped (real ones take a millisecond)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatTemplate:
    """A checked, compiled chat template and the special tokens it is given."""

    def __init__(self, source: str, special_tokens: dict[str, Any], where: str):
        if len(source.encode()) > MAX_TEMPLATE_BYTES:
            raise BadInput(
                f"{where}: its chat_template is {len(source.encode()):,} bytes, more than the {MAX_TEMPLATE_BYTES:,}"
                " a chat template may be: shorten it or remove it"
            )
        import jinja2
        from jinja2 import nodes

        from gpt2onnx.serving.openai.sandbox import Environment

        env = Environment()
        try:
            tree = env.parse(source)
        except jinja2.TemplateSyntaxError as err:
            message = f"its chat_template is not a valid template (line {err.lineno}: {err.message})"
            raise BadInput(f"{where}: {message}") from None
        for node in tree.find_all((nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport)):
            raise BadInput(
                f"{where}: its chat_template has {type(node).__name__.lower()} (line {node.lineno}), and a chat"
                " template may read no other file: remove it"
            )
        for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
            name = node.attr if isinstance(node, nodes.Getattr) else getattr(node.arg, "value", None)
            if isinstance(name, str) and name.startswith("_"):
                raise BadInput(
                    f"{where}: its chat_template reads {name!r} (line {node.lineno}), a private attribute: a chat"
                    " template may read no attribute starting with '_': remove it"
                )
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as err:
            raise BadInput(f"{where}: its chat_template cannot be compiled ({_line(err)}): fix it") from None
        self.special_tokens = special_tokens

    @classmethod
    def from_folder(cls, folder: Path) -> "ChatTemplate | None":
        """The folder's chat template (tokenizer_config.json's ``chat_template``: a string, or a list of named ones
        of which ``default`` is taken), None where it has none; BadInput (one line) where it is refused."""
        if not (folder / TOKENIZER_CONFIG).is_file():
            return None
        path = file_in_folder(folder, TOKENIZER_CONFIG, what="tokenizer file", where=folder)
        config = read_json_file(path, "tokenizer config")
        template = config.get("chat_template")
        where = f"'{path}'"
        if isinstance(template, list):
            if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in template):
                raise BadInput(
                    f"{where}: its chat_template is a list whose items are not {{name, template}}: give the template"
                    " as text, or remove it"
                )
            named = {t["name"]: t.get("template") for t in template}
            if "default" not in named:
                raise BadInput(
                    f"{where}: its chat_template lists {', '.join(sorted(named))[:80]} and none named 'default':"
                    " name the one to serve 'default'"
                )
            template = named["default"]
        if template is None or template == "":
            return None
        if not isinstance(template, str):
            raise BadInput(f"{where}: its chat_template is not a string: give the template as text, or remove it")
        special = {}
        for name in SPECIAL_TOKENS:
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                special[name] = value
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            special["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
        return cls(template, special, where)

    def render(self, messages: list[dict]) -> str:
        """The prompt for ``messages`` (with the assistant's turn opened); ApiError 400 naming why it could not be
        rendered (the template's own ``raise_exception``, a sandbox refusal, a limit)."""
        variables = {
            **self.special_tokens,
            "messages": messages,
            "add_generation_prompt": True,
            "tools": None,
            "documents": None,
        }
        import jinja2

        from gpt2onnx.serving.openai.sandbox import MAX_RENDER_CHARS, Refused

        deadline = time.monotonic() + RENDER_SECONDS

        def on_line(frame, event, arg):
            if time.monotonic() > deadline:
                raise Refused(f"it ran longer than {RENDER_SECONDS:g} s")
            return on_line

        def on_call(frame, event, arg):  # every call on this thread; the template's own lines too
            if time.monotonic() > deadline:
                raise Refused(f"it ran longer than {RENDER_SECONDS:g} s")
            return on_line if frame.f_code.co_filename == "<template>" else None

        previous = sys.gettrace()
        sys.settrace(on_call)
        try:
            parts, size = [], 0
            for part in self.template.generate(**variables):
                size += len(part)
                if size > MAX_RENDER_CHARS:
                    raise Refused(f"its output is longer than {MAX_RENDER_CHARS:,} characters")
                parts.append(part)
            return "".join(parts)
        except jinja2.TemplateError as err:
            raise ApiError(
                400, f"the model's chat template refused these messages: {_line(err)}", param="messages",
                code="chat_template_error",
            ) from None  # fmt: skip
        except (Refused, RecursionError, MemoryError) as err:
            why = str(err) if isinstance(err, Refused) else "it recursed too deeply" if isinstance(
                err, RecursionError) else "it ran out of memory"  # fmt: skip
            raise ApiError(
                400, f"the model's chat template was stopped: {why}", param="messages", code="chat_template_error"
            ) from None
        except Exception as err:  # the template's own arithmetic or types (a TypeError, a ZeroDivisionError)
            raise ApiError(
                400, f"the model's chat template failed on these messages: {type(err).__name__}: {_line(err)}",
                param="messages", code="chat_template_error",
            ) from None  # fmt: skip
        finally:
            sys.settrace(previous)


def _line(err: Exception) -> str:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def chat_messages(messages: list) -> list[dict]:
    """The request's messages as a template reads them: role, content (a string: text parts joined by newlines),
    name where given; ApiError 400 for a role or a part this text model cannot take."""
    out = []
    for i, message in enumerate(messages):
        role, content = message.role, message.content
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}", param="messages")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ApiError(
                        400, f"messages[{i}].content has a part of type {kind!r}: this model reads text parts only",
                        param="messages",
                    )  # fmt: skip
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        item = {"role": role, "content": content}
        name = getattr(message, "name", None)
        if isinstance(name, str):
            item["name"] = name
        out.append(item)
    return out
