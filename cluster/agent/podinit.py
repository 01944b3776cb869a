"""The launcher of one container process: private mount and UTS namespaces, bind mounts, the
pod's hostname, exec.

Run as `python podinit.py SPEC.json`. The spec says: argv, env, cwd, the mounts (source, target,
readOnly), the hostname (or null: keep the host's) and where to report an exec failure. The
launcher replaces itself with the container's command, so the container's pid is the launcher's
pid and its process group is the one the agent created. Standard library only: it must start fast.

`python podinit.py --check` exits 0 when private mount and UTS namespaces work here (root or
CAP_SYS_ADMIN), else prints why and exits 1.
"""

import ctypes
import json
import os
import sys

CLONE_NEWNS, CLONE_NEWUTS = 0x00020000, 0x04000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
EXIT_START_ERROR = 128  # what containerd reports for a container that could not start

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, flags):
    _check(_libc.mount(source and source.encode(), target.encode(), None, flags, None),
           f"mount {source or ''} {target}")


def enter_private_namespaces() -> None:
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare(CLONE_NEWNS | CLONE_NEWUTS)")
    # Without this, our bind mounts would propagate back to the host's shared mounts.
    _mount(None, "/", MS_REC | MS_PRIVATE)


def set_hostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, len(raw)), f"sethostname {name}")


def bind(source: str, target: str, read_only: bool) -> None:
    _mount(source, target, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, MS_BIND | MS_REMOUNT | MS_RDONLY)


def main(argv: list) -> None:
    if argv[1:] == ["--check"]:
        try:
            enter_private_namespaces()
        except OSError as exc:
            print(exc)
            sys.exit(1)
        sys.exit(0)
    with open(argv[1]) as f:
        spec = json.load(f)
    command = spec["argv"][0]
    try:
        if spec["mounts"] or spec.get("hostname"):
            enter_private_namespaces()
            for m in spec["mounts"]:
                bind(m["source"], m["target"], m["readOnly"])
            if spec.get("hostname"):
                set_hostname(spec["hostname"])
        os.chdir(spec["cwd"])
    except OSError as exc:
        _fail(spec, f"setting up the container: {exc}")
    try:
        # The spec's environment, not ours: Python's start-up may have added LC_CTYPE to ours.
        os.execvpe(command, spec["argv"], spec["env"])
    except FileNotFoundError:
        where = "" if "/" in command else " in $PATH"
        _fail(spec, f'exec: "{command}": executable file not found{where}')
    except PermissionError:
        _fail(spec, f'exec: "{command}": permission denied')
    except OSError as exc:
        _fail(spec, f'exec: "{command}": {exc.strerror}')


def _fail(spec: dict, message: str) -> None:
    with open(spec["startErrorFile"], "w") as out:
        json.dump({"reason": "StartError", "message": message}, out)
    print(f"adpfleet node agent: {message}", file=sys.stderr)
    os._exit(EXIT_START_ERROR)


if __name__ == "__main__":
    main(sys.argv)
