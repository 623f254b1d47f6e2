"""critic_test: one py_test per test file, run through pytest, tagged by what hardware it needs.

Every test file ends with `run_pytest(__file__)` (common/tests/helpers.py), so a test is just the
file as `main`. `multiprocess` tests launch torchrun themselves: they are `large`, exclusive (they
use both cores) and tagged so a suite can pick them.
"""

def critic_test(name, src = None, deps = [], data = [], size = "medium", multiprocess = False, tags = [], **kwargs):
    src = src or name + ".py"
    extra_tags = ["cpu"]
    if multiprocess:
        extra_tags += ["multiprocess", "exclusive"]
        size = "large"
    native.py_test(
        name = name,
        srcs = [src],
        main = src,
        deps = deps,
        data = data,
        size = size,
        python_version = "PY3",
        srcs_version = "PY3",
        tags = tags + extra_tags,
        **kwargs
    )
