"""`adpfleet fetch-model` as the init container runs it: its own process, progress every 0.2 s."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def fetch_process(env_dir: Path, uri: str, **extra_env) -> subprocess.Popen:
    env = {**os.environ, "ADPFLEET_PROGRESS_INTERVAL": "0.2", **extra_env}
    return subprocess.Popen([sys.executable, "-m", "adpfleet", "fetch-model", uri], env=env, cwd=env_dir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
