"""User category rules: a small TOML file of frame / metadata patterns -> category.

    # rules.toml: first matching rule wins; rules override tags and inference.
    [[rule]]
    category = "kv_cache"          # any name; new names become extra categories
    file = "models/cache\\.py$"    # regex searched in a frame's filename
    function = "update"            # regex on that same frame's function name
    line = 42                      # that frame's line

    [[rule]]
    category = "activation"
    metadata = "my_forward"        # regex searched in the allocation's user_metadata
    min_size = "1MiB"              # and/or max_size
    only = "temporary"             # only re-label allocations currently in this category

Every condition given must hold; a rule needs at least one of file,
function, line, metadata, min_size, max_size.
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field

import numpy as np

from ..errors import TracekitError
from ..units import parse_bytes

KEYS = {"category", "file", "function", "line", "metadata", "min_size", "max_size", "only"}


@dataclass
class Rule:
    category: str
    file: re.Pattern | None = None
    function: re.Pattern | None = None
    line: int | None = None
    metadata: re.Pattern | None = None
    min_size: int | None = None
    max_size: int | None = None
    only: str | None = None

    @property
    def frame_test(self) -> bool:
        return self.file is not None or self.function is not None or self.line is not None

    def frame_matches(self, filename: str, line: int, name: str) -> bool:
        return ((self.file is None or bool(self.file.search(filename)))
                and (self.function is None or bool(self.function.search(name)))
                and (self.line is None or line == self.line))


@dataclass(eq=False)  # hashed by identity: analyses are memoised per (trace, rules object)
class Rules:
    rules: list[Rule] = field(default_factory=list)
    path: str = ""

    def __bool__(self):
        return bool(self.rules)

    @property
    def categories(self) -> list[str]:
        out = []
        for r in self.rules:
            if r.category not in out:
                out.append(r.category)
        return out

    @classmethod
    def load(cls, path) -> "Rules":
        """Read a rules file; TracekitError with the file and the problem if it is not valid."""
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise TracekitError(f"cannot read rules file {path}: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise TracekitError(f"rules file {path} is not valid TOML: {e}") from None
        return cls.parse(data, str(path))

    @classmethod
    def parse(cls, data: dict, path: str = "<rules>") -> "Rules":
        items = data.get("rule", [])
        if not isinstance(items, list) or not items:
            raise TracekitError(f"rules file {path} has no [[rule]] tables")
        out = []
        for i, item in enumerate(items, 1):
            where = f"rules file {path}, rule {i}"
            if not isinstance(item, dict):
                raise TracekitError(f"{where}: not a table")
            unknown = set(item) - KEYS
            if unknown:
                raise TracekitError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} "
                                    f"(known: {', '.join(sorted(KEYS))})")
            cat = item.get("category")
            if not isinstance(cat, str) or not re.fullmatch(r"[A-Za-z_][\w.-]*", cat):
                raise TracekitError(f"{where}: 'category' must be a name such as \"kv_cache\"")
            if not set(item) - {"category", "only"}:
                raise TracekitError(f"{where}: give at least one of file, function, line, metadata, "
                                    "min_size, max_size")
            try:
                out.append(Rule(
                    category=cat,
                    file=_regex(item.get("file")), function=_regex(item.get("function")),
                    line=int(item["line"]) if "line" in item else None,
                    metadata=_regex(item.get("metadata")),
                    min_size=_size(item.get("min_size")), max_size=_size(item.get("max_size")),
                    only=item.get("only"),
                ))
            except (re.error, ValueError, TypeError) as e:
                raise TracekitError(f"{where}: {e}") from None
        return cls(out, path)

    def apply(self, trace, rep, names: list, current=None) -> np.ndarray:
        """Category index (into `names`) per allocation where a rule matches, else -1.

        `current` (labels decided so far) is what `only` compares against."""
        al = rep.allocations
        out = np.full(len(al), -1, np.int16)
        if not len(al):
            return out
        stack = al.stack_id
        meta_ids = np.zeros(len(al), np.int64)
        traced = al.alloc_index >= 0
        um = trace.events.user_metadata[rep.events]
        meta_ids[traced] = um[al.alloc_index[traced]]
        for rule in self.rules:
            mask = out < 0
            if rule.min_size is not None:
                mask &= al.size >= rule.min_size
            if rule.max_size is not None:
                mask &= al.size <= rule.max_size
            if rule.only is not None and current is not None:
                mask &= current == (names.index(rule.only) if rule.only in names else -2)
            if rule.metadata is not None:
                ok_ids = [i for i in np.unique(meta_ids[mask]).tolist() if rule.metadata.search(trace.strings[i])]
                mask &= np.isin(meta_ids, ok_ids)
            if rule.frame_test:
                ok = [s for s in np.unique(stack[mask]).tolist() if s >= 0 and any(
                    rule.frame_matches(f["filename"], f["line"], f["name"]) for f in trace.stack(s))]
                mask &= np.isin(stack, ok)
            out[mask] = names.index(rule.category)
        return out


def _regex(value):
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"expected a string pattern, got {value!r}")
    return re.compile(value)


def _size(value):
    if value is None:
        return None
    return parse_bytes(str(value))
