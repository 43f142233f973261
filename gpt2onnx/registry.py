"""One shape for every kind of plug-in: a :class:`Registry` maps each name to the plug-in a module declares (a
profile, a cache layout, a precision, an int4 algorithm, a K/V cache type, a prompt kernel, a provider, a runtime,
a deploy target, a proposer), in the order they were registered, and refuses any other name in one line that names
the choices. Each kind keeps its registry in ``all_<kinds>.py`` beside the module that defines the kind (or in that
module, for a kind of a few entries); a new plug-in is a module and a line there.

requires: plug-ins with distinct names. ensures: lookups by name, the choices in order (for help and errors), and
one refusal wording for every kind (``unknown --fusion 'x': choose one of none, ort, ...``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

from gpt2onnx.errors import BadInput, ContractError

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """The plug-ins of one kind by name (a read-only mapping, in registration order).

    kind: what one plug-in is, in words ("fusion profile"). option: the command-line option that names one
    ("--fusion"; empty where none does). key: a plug-in's name (its ``name`` by default). extra: names the
    option takes besides the plug-ins (--quantize's "none", --kv-cache's "float"), listed first in the choices.
    """

    def __init__(
        self,
        kind: str,
        items: Iterable[T],
        *,
        option: str = "",
        key: Callable[[T], str] = lambda item: item.name,
        extra: tuple[str, ...] = (),
    ):
        self.kind, self.option, self.extra = kind, option, extra
        self._items: dict[str, T] = {}
        for item in items:
            name = key(item)
            if name in self._items or name in extra:
                raise ContractError(f"two {kind}s are registered as '{name}'")
            self._items[name] = item

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def keys(self):  # the dict's own views: ordered and reversible, as the registries' callers use them
        return self._items.keys()

    def values(self):
        return self._items.values()

    def items(self):
        return self._items.items()

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._items)})"

    def choices(self) -> str:
        """The names the option takes, in order, for help texts and refusals."""
        return ", ".join([*self.extra, *self._items])

    def refusal(self, name: object, advice: str = "") -> BadInput:
        """The one-line refusal of a name that is not registered (``advice``: what else to say, after a ';')."""
        what = self.option or self.kind
        return BadInput(f"unknown {what} '{name}': choose one of {self.choices()}{f'; {advice}' if advice else ''}")

    def lookup(self, name: str, advice: str = "") -> T:
        """The plug-in registered as ``name``, or :meth:`refusal`."""
        if not isinstance(name, str) or name not in self._items:
            raise self.refusal(name, advice)
        return self._items[name]
