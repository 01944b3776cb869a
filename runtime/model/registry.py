"""Model architectures, found by the `model_type` of a Hugging Face `config.json`.

An architecture is one small module in `architectures/` that declares
- how its `config.json` maps onto `ModelConfig` (the fields beyond those every decoder shares), and
- how its checkpoint's tensor names map onto the parameters of `CausalLM` (`WeightRule`s: packed
  q/k/v and gate/up projections, expert layouts). A name no rule matches is the parameter's name.
Each parameter knows how to place a checkpoint tensor into itself (its `weight_loader`: which rows
of a packed projection, which shard this rank keeps, which experts are local), so the loader
stays generic. A new architecture is a new module here; nothing else needs to import it.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from adpfleet.model_uri import UNSUPPORTED_MODEL_TYPE
from adpfleet.runtime.model.errors import ModelLoadError


class ConfigReader:
    """Typed reads of a raw `config.json`; every refusal names the file and the key."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def positive_int(self, key: str) -> int:
        value = self.raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(f"{self.source}: '{key}' must be a positive integer, got {value!r}")
        return value

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.raw.get(key, default)
        return default if value is None else bool(value)

    def refuse(self, key: str, why: str) -> None:
        """`key` is set to something adpfleet does not run."""
        raise ModelLoadError(f"{self.source}: {key}={self.raw.get(key)!r} is not supported ({why})")


@dataclass(frozen=True)
class WeightRule:
    """Checkpoint tensors whose name matches `pattern` (searched) fill the parameter named by
    replacing the match with `target`. The shard of the parameter they fill comes from the
    pattern's named groups `part` (q/k/v, gate/up) and `expert`, or from `part` given here."""
    pattern: str
    target: str
    part: str | None = None

    def apply(self, name: str) -> tuple[str, dict] | None:
        m = re.search(self.pattern, name)
        if m is None:
            return None
        shard = {k: (int(v) if k == "expert" else v) for k, v in m.groupdict().items() if v is not None}
        if self.part is not None:
            shard["part"] = self.part
        return name[:m.start()] + m.expand(self.target) + name[m.end():], shard


@dataclass(frozen=True)
class Architecture:
    model_type: str          # config.json's `model_type`
    hf_class: str            # the transformers class its checkpoints are saved from
    config: Callable[[ConfigReader], dict]  # ModelConfig fields beyond the shared ones
    weights: tuple[WeightRule, ...] = ()    # first match wins

    def parameter_for(self, name: str) -> tuple[str, dict]:
        """The parameter a checkpoint tensor fills and the shard ids its weight loader takes."""
        for rule in self.weights:
            mapped = rule.apply(name)
            if mapped is not None:
                return mapped
        return name, {}


@cache
def architectures() -> dict[str, Architecture]:
    """Every module in `architectures/` that declares an `ARCHITECTURE`, by model_type."""
    from adpfleet.runtime.model import architectures as package

    found: dict[str, Architecture] = {}
    for info in pkgutil.iter_modules(package.__path__):
        arch = getattr(importlib.import_module(f"{package.__name__}.{info.name}"), "ARCHITECTURE", None)
        if isinstance(arch, Architecture):
            found[arch.model_type] = arch
    return dict(sorted(found.items()))


def architecture(model_type, source: str = "config.json") -> Architecture:
    arch = architectures().get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise ModelLoadError(f"{source}: unsupported model_type {model_type!r}; adpfleet runs "
                             f"{', '.join(architectures())}", UNSUPPORTED_MODEL_TYPE)
    return arch
