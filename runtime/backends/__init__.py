"""Engine backends: each runs the step contract of docs/architecture.md on its own buffers and speaks
``runtime.contract.Backend``: ``step`` (score W tokens per row, keep logits / hidden / new K/V,
return a ``StepOutput`` with the base argmax per node on the host and the logits on demand),
``commit`` (copy chosen nodes' K/V into the cache), ``relayout`` and ``propose`` (Medusa heads
at one node per row, a ``Proposals`` with the top-k ids on the host).
"""
