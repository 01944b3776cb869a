"""Build (or find built) the C++ kernels: `python -m adpfleet.runtime.model.kernels` (run by ./scripts/setup)."""

import time

from adpfleet.runtime.model.kernels import load

start = time.perf_counter()
library = load(verbose=False)
print(f"adpfleet kernels: {library} ({time.perf_counter() - start:.1f} s)")
