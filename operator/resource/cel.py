"""The machinery every model of the resource is built on: cross-field rules written once as a `CelRule`
that carries both its CEL text (enforced by the API server at apply time) and the same check in
Python (enforced by `model_validate`, so the operator and the unit tests apply identical rules), and
`KubeModel`, the base class that puts the rules into the schema and runs their twins.

YAML names are camelCase (`adpRanks`); Python names are snake_case (`adp_ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel


@dataclass(frozen=True)
class CelRule:
    """A cross-field rule: `rule` is CEL over `self` (the object the rule sits on), `check` is the
    same predicate in Python over the model instance, `field_path` is where the API server points
    its error (relative to the object, e.g. `.gpusPerServer`)."""
    rule: str
    message: str
    field_path: str | None
    check: Callable[[Any], bool]

    def to_schema(self) -> dict:
        out = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
            out["reason"] = "FieldValueInvalid"
        return out


def cel_checked(*rules: CelRule) -> tuple:
    """Annotated metadata putting CEL rules on a scalar field (`self` is its value) and running
    their Python twins on it: `Annotated[str, *cel_checked(rule, ...)]`."""
    def validate(value):
        for rule in rules:
            if not rule.check(value):
                raise ValueError(rule.message)
        return value
    return (Field(json_schema_extra={"x-kubernetes-validations": [r.to_schema() for r in rules]}),
            AfterValidator(validate))


def _add_cel_rules(schema: dict, model: type) -> None:
    rules = getattr(model, "cel_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.to_schema() for r in rules]


class KubeModel(BaseModel):
    """camelCase in YAML, unknown fields refused, CEL rules checked in Python too."""
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              json_schema_extra=_add_cel_rules)
    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self):
        for rule in type(self).cel_rules:
            if not rule.check(self):
                raise ValueError(rule.message)  # the message names the field
        return self

    def to_kube(self) -> dict:
        """The object as it appears in Kubernetes (camelCase, unset optional fields left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def cel_list(values) -> str:
    """A CEL list literal of strings: `['a', 'b']`."""
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"
