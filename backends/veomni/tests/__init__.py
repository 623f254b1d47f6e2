"""Tests of the VeOmni engine (multi-process ones launch torchrun themselves)."""
