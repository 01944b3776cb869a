"""Reading Prometheus text: the samples of the families a dialect wants, every line's shape checked.

A scrape of every rank of every server every few seconds is most of the operator's work at scale,
so only the wanted families' labels and values are parsed. Every line's shape is still checked
(garbage is refused, not skipped): by one regular expression over the whole text in the common
case, and line by line, to name the bad line, when that does not match.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Collection, Iterable, Iterator, Mapping

MAX_METRICS_BYTES = 4 * 1024 * 1024  # a server's /metrics is a few KiB (vLLM's ~60); more is not a server

Sample = tuple[str, str, float]  # (family name, label text between the braces, value)


class ScrapeError(ValueError):
    """The text is not a server's /metrics: what is wrong, in one line."""


# The fast path's grammar: a strict subset of what the line-by-line path accepts (so both agree on
# every text it matches): `name{labels} value [timestamp]` with single spaces' worth of separators,
# the value in Prometheus's own forms, no '}' after the labels (the labels end at the line's last '}').
_VALUE_RE = r"[-+]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|Inf)|NaN"
_SAMPLE_RE = r"[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^\n]*\})? +(?:" + _VALUE_RE + r")(?: +[^\s}]+)? *"
_EXPOSITION = re.compile(r"(?:(?:#[^\n]*|" + _SAMPLE_RE + r")?\n)*(?:#[^\n]*|" + _SAMPLE_RE + r")?")
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")


class SampleReader:
    """The samples of the `wanted` families in a text, in order: `reader(text)` yields (name,
    labels, value) and raises `ScrapeError` for a text that is not Prometheus text or is too large."""

    def __init__(self, wanted: Collection[str]):
        self.wanted = frozenset(wanted)
        # a wanted sample at a line's start ("\n" + text: a literal "\n" is faster than ^ in MULTILINE)
        self._sample = re.compile(r"\n(" + "|".join(map(re.escape, sorted(self.wanted))) +
                                  r")(?:\{([^\n]*)\})? +(" + _VALUE_RE + ")")

    def __call__(self, text: str) -> Iterator[Sample]:
        if len(text) > MAX_METRICS_BYTES:
            raise ScrapeError(f"/metrics is {len(text)} bytes, more than {MAX_METRICS_BYTES}: not a server's")
        if _EXPOSITION.fullmatch(text) is not None:
            return ((m.group(1), m.group(2) or "", float(m.group(3))) for m in self._sample.finditer("\n" + text))
        return self._line_by_line(text)

    def _line_by_line(self, text: str) -> Iterator[Sample]:
        lines = []  # checked whole before any is yielded: a bad line refuses the text, wherever it is
        for number, line in enumerate(text.split("\n"), 1):
            if not line or line[0] == "#":
                continue
            name, labels, rest = _split_line(line)
            value = _value(rest) if name is not None else None
            if value is None:
                raise ScrapeError(f"not Prometheus text: line {number}: {line[:80]!r}")
            if name in self.wanted:
                lines.append((name, labels, value))
        return iter(lines)


def per_rank(samples: Iterable[Sample], rank_label: str, fields: Mapping[str, str],
             signed: Collection[str] = ()) -> dict[int, dict[str, float]]:
    """{rank: {field: value}} of samples keyed by the integer label `rank_label`, `fields` mapping
    each family to its field. A sample without that label, or with a NaN, an infinity or (for a field
    not in `signed`) a negative value, refuses the text."""
    values: dict[int, dict[str, float]] = {}
    for name, labels, value in samples:
        rank = integer_label(labels, rank_label)
        if rank is None:
            raise ScrapeError(f"{name} has no integer {rank_label!r} label: {{{labels}}}")
        field = fields[name]
        if math.isnan(value) or math.isinf(value) or (value < 0 and field not in signed):
            raise ScrapeError(f"{name}{{{rank_label}={rank}}} is {value}")
        values.setdefault(rank, {})[field] = value
    return values


def label(labels: str, key: str) -> str | None:
    """The value of label `key` in a sample's label text, None when it has none."""
    match = _label_re(key).search(labels)
    return match.group(1) if match else None


def integer_label(labels: str, key: str) -> int | None:
    text = label(labels, key)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


@lru_cache(maxsize=None)
def _label_re(key: str) -> re.Pattern:
    return re.compile(r'(?:^|,)\s*' + re.escape(key) + r'\s*=\s*"([^"]*)"')


def _split_line(line: str) -> tuple[str | None, str, str]:
    """(metric name, label text, the rest) of one sample line; name None when it is not one."""
    brace = line.find("{")
    space = line.find(" ")
    if brace >= 0 and (space < 0 or brace < space):
        close = line.rfind("}")
        if close < brace:
            return None, "", ""
        name, labels, rest = line[:brace], line[brace + 1:close], line[close + 1:]
    elif space > 0:
        name, labels, rest = line[:space], "", line[space:]
    else:
        return None, "", ""
    return (name if _NAME.match(name) else None), labels, rest


def _value(rest: str) -> float | None:
    """The sample value (an optional timestamp may follow it)."""
    parts = rest.split()
    if not 1 <= len(parts) <= 2:
        return None
    try:
        return float(parts[0])
    except ValueError:
        return None
