"""How hard the searching tests look: the property tests' examples and the progress search's seeds.

The suite runs the CI profile, a fraction of each full budget, so that it stays within its time on
two cores; the deep profile runs every full budget: `pytest --deep` or `HYPOTHESIS_PROFILE=deep`
(README.md, Development). Read when a test module is imported, after conftest.py has read the
command line."""

import os

CI_SHARE = 4  # the CI profile runs a quarter of each property test's full budget ...
CI_MIN_EXAMPLES = 25  # ... and never fewer examples than this


def deep() -> bool:
    return os.environ.get("HYPOTHESIS_PROFILE") == "deep"


def budget(full: int, ci: int) -> int:
    """`full` under the deep profile, `ci` otherwise."""
    return full if deep() else ci


def ci_examples(full: int) -> int:
    return max(CI_MIN_EXAMPLES, full // CI_SHARE)


def examples(full: int) -> int:
    """A property test's max_examples: its full budget under the deep profile, a share of it in CI."""
    return budget(full, ci_examples(full))
