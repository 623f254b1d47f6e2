"""Run inside one trl environment of the matrix (see test_trl_matrix.py); exits non-zero on failure.

  python -m critic_adapters.common.tests.trl_env_check --fixtures DIR --expect {class,none} [--trl-version V] [--block trl|trl.experimental.ppo]

--block makes the named module unimportable first (no trl at all, or a trl without the
experimental location), before anything else is imported.
"""

import argparse
import importlib.abc
import sys


class _Blocker(importlib.abc.MetaPathFinder):
    def __init__(self, name):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            raise ImportError(f"{fullname} blocked for this test environment")
        return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixtures", required=True)
    parser.add_argument("--expect", choices=["class", "none"], required=True)
    parser.add_argument("--trl-version")
    parser.add_argument("--block")
    parser.add_argument("--expect-module")
    args = parser.parse_args()
    if args.block:
        sys.meta_path.insert(0, _Blocker(args.block))

    import json
    import os
    import tempfile

    import torch

    from critic_adapters.common.valuehead import compute_values, load_critic
    from critic_adapters.common.valuehead.trl_compat import installed_trl_version, require_trl_value_head_class, trl_value_head_class

    if args.trl_version:
        assert installed_trl_version() == args.trl_version, (installed_trl_version(), args.trl_version)
    cls = trl_value_head_class()
    if args.expect == "none":
        assert cls is None, f"expected no value-head class, got {cls}"
        try:
            require_trl_value_head_class()
        except ImportError as err:
            assert "trl>=0.27,<1.13" in str(err), err
        else:
            raise AssertionError("require_trl_value_head_class did not raise")
    else:
        assert cls is not None and cls.__name__ == "AutoModelForCausalLMWithValueHead", cls
        if args.expect_module:
            assert cls.__module__.startswith(args.expect_module), cls.__module__

    # The loader reads trl checkpoints written by trl 1.12 in every environment, trl or not.
    with open(os.path.join(args.fixtures, "cases.json")) as f:
        cases = json.load(f)
    for name in cases:
        case = torch.load(os.path.join(args.fixtures, f"{name}.pt"))
        model, report = load_critic(os.path.join(args.fixtures, name))
        assert report.format == "trl-value-head" and report.head == "loaded", (name, report)
        with torch.no_grad():
            values = compute_values(model, case["ids"], case["mask"])
        values = torch.where(case["mask"].bool(), values, torch.zeros_like(values))  # reference is 0 on padding
        diff = float((values - case["values"]).abs().max())
        assert diff <= 2e-5, f"{name}: {diff}"
        print(f"ok {name}: max diff {diff:.2e}")

    if cls is not None:
        # And checkpoints written by *this* trl's own save_pretrained, against this trl's own values.
        from critic_adapters.common.testdata import tiny_causal_lm

        wrapper = cls.from_pretrained(tiny_causal_lm("qwen2", seed=3), summary_dropout_prob=0.0).eval()
        with tempfile.TemporaryDirectory() as tmp:
            wrapper.save_pretrained(tmp)
            model, report = load_critic(tmp)
            ids = torch.randint(3, 990, (2, 7))
            mask = torch.ones_like(ids)
            with torch.no_grad():
                diff = float((compute_values(model, ids, mask) - wrapper(input_ids=ids, attention_mask=mask)[2]).abs().max())
            assert diff <= 2e-5, diff
            print(f"ok own-save: max diff {diff:.2e}")
    print("trl environment OK")


if __name__ == "__main__":
    main()
