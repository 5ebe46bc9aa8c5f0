"""Engine backends: each runs the step contract of DESIGN.md on its own buffers.

A backend offers ``step`` (score T tokens, keep logits/hidden/new K/V on the device, return the
base model's argmax per node to the host), ``commit`` (copy chosen nodes' K/V into the cache)
and ``propose`` (Medusa heads at one node per sequence, top-k ids to the host).
"""
