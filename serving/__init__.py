"""Serving an engine: the request schema and the servers' options (defined once), the OpenAI-compatible
HTTP server, the Triton model repository and its Python-backend model, metrics, the Triton server's
process management and a small client.

    schema         ServeDefaults (per-request defaults and limits), EngineOptions (the engine a server
                   runs), the Triton model's inputs and outputs, ``make_request`` (one validation for
                   every front end)
    openai_app     the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health,
                   /metrics) as a FastAPI app over a ``ContinuousBatcher``
    openai_server  ``OpenAIServerConfig`` and ``serve_openai``: load the engine, run uvicorn
    triton_repo    ``TritonRepoConfig`` and ``write_triton_repo``: a model repository that serves an engine
    triton_model   the Triton Python-backend model (copied into the repository as ``1/model.py``)
    metrics        the metric names, what feeds them (a ``BatchObserver``) and the Prometheus sink
    triton         the tritonserver process bundled in nvidia-pytriton (``TritonServer``)
    client         ``stream_generate`` (Triton gRPC) and ``stream_completion`` (OpenAI SSE, stdlib)

Nothing here is imported by ``runtime`` or ``exporter``; modules import FastAPI, uvicorn,
prometheus_client or tritonclient only where they use them (the ``serve`` extra), so the lean
install can import ``schema``, ``metrics``, ``triton_repo`` and ``triton_model``.
"""
