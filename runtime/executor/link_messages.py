"""The group link's messages (`node_link`): what the ranks' pipes carry, as JSON of a fixed schema.

A peer on the link sends data, never code. Each message is one JSON object,

    {"rank": R, "kind": K, "args": [...]}

whose arguments are checked against the types the pipe messages carry — the dataclasses' own type
hints are the schema, so a field added to `RankStats` crosses the link without a second list of
fields — and anything else (another kind, a missing or unknown field, a value of another type) is
refused with LinkMessageError naming where. (multiprocessing's connections unpickle what they
receive: whoever could send one a message could run code in the receiver.)

The leader sends a rank in a worker pod `TO_RANK` messages, the worker sends `FROM_RANK` ones for
its ranks: their kinds and arguments are those of the pipes (`rank_process`). A Request crosses as
submitted (its id, prompt, sampling parameters, the KV to pull and the first token), with its age
rather than its arrival time: monotonic clocks of two pods do not compare.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import types
import typing

from adpfleet.runtime.engine.request import Request, RequestOutput
from adpfleet.runtime.metrics import RankStats

TO_RANK = {"add": (Request,), "abort": (str,), "transfer_done": (str,), "stop": (), "fault": (str,)}
FROM_RANK = {"ready": (int, str | None), "cache": (list[tuple[str, str]],), "out": (list[RequestOutput],),
             "stats": (RankStats,), "error": (str,)}
SUBMITTED = ("request_id", "prompt_token_ids", "params", "remote_kv", "first_token_id")  # a Request's fields that cross


class LinkMessageError(ValueError):
    pass


def encode(rank: int, msg: tuple) -> dict:
    """A pipe message (`(kind, *args)`) for or from `rank`, as the link's JSON object."""
    kind, *args = msg
    return {"rank": rank, "kind": kind, "args": [_to_json(arg) for arg in args]}


def decode(obj, kinds: dict) -> tuple[int, tuple]:
    """(rank, pipe message) from a JSON object of one of `kinds` (TO_RANK or FROM_RANK)."""
    _fields(obj, ("rank", "kind", "args"), "the message")
    rank, kind, args = obj["rank"], obj["kind"], obj["args"]
    if type(rank) is not int or rank < 0:
        raise LinkMessageError(f"'rank' must be a rank, got {str(rank)[:40]!r}")
    if kind not in kinds:
        raise LinkMessageError(f"'kind' {str(kind)[:40]!r} is not one of {', '.join(kinds)}")
    hints = kinds[kind]
    if not isinstance(args, list) or len(args) != len(hints):
        raise LinkMessageError(f"{kind}: 'args' must be a list of {len(hints)}")
    return rank, (kind, *(_from_json(arg, hint, f"{kind}[{i}]") for i, (arg, hint) in enumerate(zip(args, hints))))


def _to_json(value):
    if isinstance(value, Request):
        return {"age_s": time.monotonic() - value.arrival_time,
                **{name: _to_json(getattr(value, name)) for name in SUBMITTED}}
    if dataclasses.is_dataclass(value):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):  # keys that are tuples (RankStats.padding_dummies) become rows
        if all(isinstance(k, str) for k in value):
            return {k: _to_json(v) for k, v in value.items()}
        return [[*k, _to_json(v)] for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    return value


def _from_json(value, hint, where: str):
    """`value` as a `hint` (a type or a type hint), or LinkMessageError naming `where`."""
    if hint is Request:
        return _request(value, where)
    if dataclasses.is_dataclass(hint):
        hints = _hints(hint)
        names = [f.name for f in dataclasses.fields(hint)]
        _fields(value, names, where)
        return hint(**{name: _from_json(value[name], hints[name], f"{where}.{name}") for name in names})
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        [arm] = [a for a in args if a is not type(None)]
        return _from_json(value, arm, where)
    if origin is list:
        _expect(isinstance(value, list), where, "a list")
        return [_from_json(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        _expect(isinstance(value, list) and len(value) == len(args), where, f"a list of {len(args)}")
        return tuple(_from_json(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        return _dict(value, *args, where)
    if hint is float:
        _expect(type(value) in (int, float), where, "a number")
        return float(value)
    if hint in (bool, int, str):
        _expect(type(value) is hint, where, f"a {hint.__name__}")
        return value
    raise LinkMessageError(f"{where}: no schema for {hint!r}")


def _dict(value, key_hint, value_hint, where: str) -> dict:
    if key_hint is str:
        _expect(isinstance(value, dict), where, "an object")
        return {k: _from_json(v, value_hint, f"{where}.{k}") for k, v in value.items()}
    width = len(typing.get_args(key_hint))  # tuple keys: rows of the key's parts, then the value
    _expect(isinstance(value, list), where, "a list of rows")
    rows = {}
    for i, row in enumerate(value):
        _expect(isinstance(row, list) and len(row) == width + 1, f"{where}[{i}]", f"a list of {width + 1}")
        rows[_from_json(row[:width], key_hint, f"{where}[{i}]")] = _from_json(row[width], value_hint, f"{where}[{i}]")
    return rows


def _request(value, where: str) -> Request:
    hints = _hints(Request)
    _fields(value, ("age_s", *SUBMITTED), where)
    fields = {name: _from_json(value[name], hints[name], f"{where}.{name}") for name in SUBMITTED}
    age = _from_json(value["age_s"], float, f"{where}.age_s")
    return Request(**fields, arrival_time=time.monotonic() - age)


def _fields(value, names, where: str) -> None:
    _expect(isinstance(value, dict), where, "a JSON object")
    if set(value) != set(names):
        missing, unknown = sorted(set(names) - set(value)), sorted(set(value) - set(names))
        raise LinkMessageError(f"{where}: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) +
            ([f"unknown {', '.join(k[:40] for k in unknown)}"] if unknown else [])))


def _expect(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise LinkMessageError(f"{where} must be {what}")


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)
