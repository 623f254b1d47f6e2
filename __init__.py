"""critic-adapters: one PPO critic (value model) for RL-for-LLM stacks, on several training backends.

This directory is the package `critic_adapters` (pip install -e . here, or a Bazel workspace of the
same name); inside it every import is relative, so a copy under any package path works unchanged.
"""
