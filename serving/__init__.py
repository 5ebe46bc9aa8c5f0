"""Serving an engine: the request schema (defined once), the OpenAI-compatible HTTP server, metrics,
the Triton server's process management and a small client.

    schema         ServeDefaults (per-request defaults and limits), the Triton model's inputs and
                   outputs, ``make_request`` (one validation for every front end)
    openai_app     the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health,
                   /metrics) as a FastAPI app over a ``ContinuousBatcher``
    openai_server  ``OpenAIServerConfig`` and ``serve_openai``: load the engine, run uvicorn
    metrics        the metric names, what feeds them (a ``BatchObserver``) and the Prometheus sink
    triton         the tritonserver process bundled in nvidia-pytriton (``TritonServer``)
    client         ``stream_generate`` (Triton gRPC) and ``stream_completion`` (OpenAI SSE, stdlib)

The Triton model repository writer and the Python-backend model stay in ``exporter``
(``triton_repo``, ``triton_model``) and read the schema from here. Nothing here is imported by
``runtime``; modules import FastAPI, uvicorn, prometheus_client or tritonclient only where they
use them (the ``serve`` extra), so the lean install can import ``schema`` and ``metrics``.
"""
