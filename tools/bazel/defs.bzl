"""critic_test: one py_test per test file, run through pytest, tagged by what hardware it needs.

Every test file ends with `run_pytest(__file__)` (common/tests/helpers.py), so a test is just the
file as `main`; test files import the package by name (critic_adapters.*), which the runfiles tree
provides (the workspace is named critic_adapters and its root holds __init__.py). `multiprocess` tests launch torchrun themselves: they are `large` and tagged so a suite can pick
them. They are not exclusive: most of a multi-process test's wall time is interpreters starting and
importing torch one after another, so two of them side by side (--local_test_jobs=2) fill each
other's idle core. `exclusive = True` keeps a test alone, after all the others (Bazel runs exclusive tests one by
one at the end, the second core idle: only test_two_nodes, whose cluster another ray.init could join).
"""

def critic_test(name, src = None, deps = [], data = [], size = "medium", multiprocess = False, exclusive = False,
                tags = [], **kwargs):
    src = src or name + ".py"
    extra_tags = ["cpu"]
    if multiprocess:
        extra_tags.append("multiprocess")
        size = "large"
    if exclusive:
        extra_tags.append("exclusive")
    native.py_test(
        name = name,
        srcs = [src],
        main = src,
        deps = deps + ["//:package"],
        data = data,
        size = size,
        python_version = "PY3",
        srcs_version = "PY3",
        tags = tags + extra_tags,
        **kwargs
    )


def critic_module_binary(name, module, deps = [], **kwargs):
    """A py_binary that runs `python -m <module>`. The repo's modules use relative imports, so their
    files cannot be a py_binary's main script themselves: a generated two-line main runs the module
    by its package name instead (as `bazel run`, or the binary's launcher run directly)."""
    main = name + "_main.py"
    native.genrule(
        name = name + "_main",
        outs = [main],
        cmd = "printf 'import runpy\\nrunpy.run_module(\"%s\", run_name=\"__main__\", alter_sys=True)\\n' > $@" % module,
    )
    native.py_binary(
        name = name,
        srcs = [main],
        main = main,
        python_version = "PY3",
        deps = deps + ["//:package"],
        **kwargs
    )


def critic_launcher_alias(backend, deps = []):
    """A backend's launcher alias (its train.py: the one launcher with the backend fixed): the
    py_library `train_lib` over train.py and the engine, and the binary `train`
    (`bazel run //backends/<backend>:train -- --nproc 2 ...`)."""
    native.py_library(
        name = "train_lib",
        srcs = ["train.py"],
        deps = deps + [":engine", "//common:job"],
    )
    critic_module_binary(
        name = "train",
        module = "critic_adapters.backends.%s.train" % backend,
        deps = [":train_lib"],
    )
