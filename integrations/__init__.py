"""Integrations of the critic with the systems RL stacks run it on (each an optional extra)."""
