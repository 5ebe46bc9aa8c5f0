"""Benchmarks beside medusa-bench: peer engines run on the same prompts (``peers``)."""
