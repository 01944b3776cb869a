"""adpfleet.operator: the kopf operator that reconciles InferenceFleets and remediates stalls."""

if __name__ == "operator":  # pragma: no cover - exercised by tests/test_packaging.py in a subprocess
    # This folder sits at the repository root, and `python` started there puts the root ahead of
    # the standard library on sys.path, so a bare `import operator` lands here. Hand back the
    # standard library's module so nothing that imports it (kopf, pydantic, ...) breaks.
    import importlib.util as _util
    import os as _os
    import sys as _sys
    import sysconfig as _sysconfig

    _spec = _util.spec_from_file_location(
        "operator", _os.path.join(_sysconfig.get_path("stdlib"), "operator.py"))
    _stdlib = _util.module_from_spec(_spec)
    _sys.modules["operator"] = _stdlib
    _spec.loader.exec_module(_stdlib)
    globals().update({k: v for k, v in vars(_stdlib).items() if not k.startswith("__")})
