"""The OpenAI-compatible server (``medusa-serve ENGINE``) as a real process on loopback, and multi-turn chat.

Each server is ``python -m medusa_trt.cli.serve ENGINE --port 0`` started here on the stories
engine folder (conftest ``stories_chat_engine``: fitted heads, a chat template, a fixed drafting
budget) and stopped by pid. Clients: the official ``openai`` package (completions and chat,
streamed and not), raw server-sent events over httpx, 16 concurrent streams; every output must be
exactly ``MedusaRuntime``'s greedy output for the same prompt. Then: a stream or a non-streaming
request whose client goes away frees its row and counts as cancelled (one-row servers, with and
without --api-key), bad requests get OpenAI-style 400s while a long request beside them completes
unchanged, /metrics counters move by exactly a known request's drafted and accepted tokens,
--api-key, loopback by default, foreign Host names and non-JSON bodies refused, SIGTERM ends
every request in flight with an answer (an error event and [DONE], a JSON 503) and no traceback,
and SIGTERM / SIGKILL leave no process, port or shared memory behind. Multi-turn: conversations
through the chat template in ``MedusaRuntime`` and ``medusa-run --messages``.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import SERVING_CHAT_TEMPLATE, STORY_PROMPTS

pytest.importorskip("fastapi", reason="the OpenAI server needs the serve extra (pip install 'medusa-trt[serve]')")
pytest.importorskip("uvicorn", reason="the OpenAI server needs the serve extra (pip install 'medusa-trt[serve]')")
pytest.importorskip("prometheus_client", reason="the OpenAI server needs the serve extra (pip install 'medusa-trt[serve]')")
openai = pytest.importorskip("openai", reason="the official openai client is in the test extra")
httpx = pytest.importorskip("httpx", reason="httpx is in the test extra")

from medusa_trt.runtime import MedusaRuntime  # noqa: E402
from medusa_trt.runtime.text import PromptError  # noqa: E402

MODEL = "stories-chat"  # the served name: the engine folder's
API_KEY = "sk-test-medusa"
PROMPTS = STORY_PROMPTS + [
    "Sam saw a frog",
    "The sky was blue and",
    "Mia had a kite. It was red and",
    "Bob",
    "Anna wanted a puppy",
    "The rain fell on the",
    "A big bear",
    "Tom and his mom baked",
    "The moon was bright",
    "Kim found a shiny",
    "There was a little car",
    "The fish swam",
]
LENGTHS = [40, 7, 25, 33, 12, 48, 3, 20, 30, 16, 44, 9, 27, 5, 38, 21]
CONVERSATION = [
    {"role": "system", "content": "You tell short stories."},
    {"role": "user", "content": "Tell me about a dog."},
    {"role": "assistant", "content": "The dog was big and happy."},
    {"role": "user", "content": "What did the dog do next?"},
]


# ---------------------------------------------------------------------------------- the server process


# medusa-serve with a step clock: each engine step takes STEP_S more, so a 240-token request of the tiny engine runs
# for seconds (long enough to hang up on, or to be stopped mid-way) on any machine, as tests/triton_step_clock_model.py does for Triton
STEP_S = 0.02
SLOW_SERVE = f"""import sys, time
from medusa_trt.runtime.scheduler import Scheduler
step = Scheduler.step
Scheduler.step = lambda self: (time.sleep({STEP_S}), step(self))[1]
from medusa_trt.cli.serve import main
sys.exit(main())
"""


class Server:
    """One ``medusa-serve`` process (its own session: its pid is its process group); ``slow``: with
    the step clock (``SLOW_SERVE``)."""

    def __init__(self, engine: Path, *args: str, log: Path, env: dict | None = None, slow: bool = False):
        self.log = log
        start = ["-c", SLOW_SERVE] if slow else ["-m", "medusa_trt.cli.serve"]
        cmd = [sys.executable, *start, str(engine), "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
            text=True,
            start_new_session=True,  # noqa: SIM115
            env=env,
        )
        lines: queue.Queue = queue.Queue()
        self.banner: list[str] = []
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout] + [lines.put(None)], daemon=True).start()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"medusa-serve exited with {self.proc.wait()} before serving: {log.read_text()[-3000:]}")
            self.banner.append(line)
            if "OpenAI" in line and "http" in line:
                self.url = re.search(r"(http://\S+)/v1", line).group(1)
                return
        self.proc.kill()
        raise AssertionError(f"medusa-serve did not start: {log.read_text()[-3000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def client(self, **kw):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        return scrape(httpx.get(f"{self.url}/metrics", timeout=30).text)

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def scrape(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="v",...}': value} (labels as written)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def total(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in metrics.items() if k.partition("{")[0] == name and all(w in k for w in want))


@pytest.fixture(scope="module")
def engine(stories_chat_engine):
    return stories_chat_engine


@pytest.fixture(scope="module")
def runtime(engine):
    return MedusaRuntime(str(engine))


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    server = Server(engine, log=tmp_path_factory.mktemp("openai-server") / "serve.log")
    yield server
    assert server.stop() == 0, server.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def one_row_server(engine, tmp_path_factory):
    """One cache row, an API key, the step clock: a request waits for the row of the one before it."""
    server = Server(
        engine, "--max-batch", "1", "--api-key", API_KEY, log=tmp_path_factory.mktemp("openai-one-row") / "serve.log", slow=True
    )
    yield server
    assert server.stop() == 0, server.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def open_one_row_server(engine, tmp_path_factory):
    """One cache row, no API key, and --allow-remote (it answers any Host name); the step clock."""
    server = Server(engine, "--max-batch", "1", "--allow-remote", log=tmp_path_factory.mktemp("openai-open") / "serve.log", slow=True)
    yield server
    assert server.stop() == 0, server.log.read_text()[-3000:]


def solo(runtime, prompt, n):
    """The runtime's own greedy output: what every server answer must equal."""
    return (
        runtime.generate(prompt, max_new_tokens=n, chat_template=False)
        if isinstance(prompt, str)
        else runtime.generate(prompt, max_new_tokens=n)
    )


def sse_events(response) -> list[str]:
    """The data of each server-sent event of an httpx streaming response, checking the framing."""
    raw = "".join(response.iter_text())
    assert raw.endswith("\n\n"), raw[-200:]
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events[:3]
    return [e[len("data: ") :] for e in events]


# ---------------------------------------------------------------------------------- outputs


def test_openai_client_completions_equal_the_runtime(server, runtime):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    for prompt, n in [(STORY_PROMPTS[2], 40), (STORY_PROMPTS[0], 24)]:
        want = solo(runtime, prompt, n)
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
        assert answer.choices[0].text == want.text and answer.choices[0].finish_reason == want.finish_reason
        assert answer.usage.completion_tokens == len(want.token_ids)
        assert answer.usage.prompt_tokens == len(runtime.codec.encode(prompt, chat=False))
        chunks = list(
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, stream=True, stream_options={"include_usage": True})
        )
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(texts) == want.text
        assert 2 < len(texts) < n, "one event per engine step, several tokens per step"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    ids = runtime.codec.encode(STORY_PROMPTS[1], chat=False)  # a prompt of token ids
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=16).choices[0].text == solo(runtime, ids, 16).text


def test_openai_client_chat_equals_the_runtime(server, runtime):
    client = server.client()
    want = runtime.generate(CONVERSATION, max_new_tokens=32)
    answer = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=32)
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content == want.text
    assert answer.usage.prompt_tokens == len(runtime.codec.encode_chat(CONVERSATION))
    assert answer.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_completion_tokens=32, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "about a cat."}]}]
    answer = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=12)
    assert (
        answer.choices[0].message.content == runtime.generate([{"role": "user", "content": "Tell me about a cat."}], max_new_tokens=12).text
    )


def test_raw_server_sent_events(server, runtime):
    want = solo(runtime, STORY_PROMPTS[3], 30)
    body = {"model": MODEL, "prompt": STORY_PROMPTS[3], "max_tokens": 30, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [want.finish_reason]
    chat = {"model": MODEL, "messages": CONVERSATION[:2], "max_tokens": 20, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat, timeout=60) as response:
        events = sse_events(response)
    chunks = [json.loads(e) for e in events[:-1]]
    reply = runtime.generate(CONVERSATION[:2], max_new_tokens=20)
    assert events[-1] == "[DONE]" and chunks[-1]["usage"]["completion_tokens"] == len(reply.token_ids)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == reply.text


def test_sixteen_concurrent_streams_each_get_their_solo_output(server, runtime):
    results, errors = {}, []

    def client(i):
        try:
            stream = server.client().completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=LENGTHS[i], stream=True)
            results[i] = "".join(c.choices[0].text for c in stream if c.choices)
        except Exception as exc:  # noqa: BLE001 - reported with the request's index
            errors.append((i, exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for i, prompt in enumerate(PROMPTS):  # 16 streams over the engine's 4 rows: most waited for a free one
        assert results[i] == solo(runtime, prompt, LENGTHS[i]).text, (
            f"stream {i} ({prompt!r}, {LENGTHS[i]} tokens) differs from its solo run"
        )


# ---------------------------------------------------------------------------------- cancellation, bad requests


def test_a_cancelled_stream_frees_its_row(one_row_server, runtime):
    """One row: a request waits for the one before it. A client that reads the first event of a
    240-token stream and goes away: its request ends as cancelled after a few steps, and the next
    request is served at once, exactly."""
    server, headers = one_row_server, {"Authorization": f"Bearer {API_KEY}"}
    before = server.metrics()
    body = {"prompt": PROMPTS[0], "max_tokens": 240, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # generating; leaving the block closes the connection
    answer = server.client(api_key=API_KEY).completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=20)
    assert answer.choices[0].text == solo(runtime, PROMPTS[4], 20).text
    after = server.metrics()
    assert (
        total(after, "medusa:requests_finished_total", finish_reason="cancelled")
        - total(before, "medusa:requests_finished_total", finish_reason="cancelled")
        == 1
    )
    generated = total(after, "medusa:generation_tokens_total") - total(before, "medusa:generation_tokens_total")
    assert generated < 240, f"the cancelled request ran on ({generated - 20} of its 240 tokens) before the next one got the row"


def _running(server, want: int, timeout: float = 30) -> dict[str, float]:
    """The server's metrics once ``want`` requests hold a row (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if total(metrics, "medusa:num_requests_running") == want or time.monotonic() > deadline:
            return metrics
        time.sleep(0.02)


@pytest.mark.parametrize("key", [None, API_KEY], ids=["no-key", "api-key"])
def test_a_dropped_request_frees_its_row(one_row_server, open_one_row_server, runtime, key):
    """One row. A non-streaming client that hangs up while its 240-token request runs: the row is
    freed within a step (the request counts as cancelled, running drops to 0, it generated fewer
    than its 240 tokens), and the next request gets the row at once and its exact output. With and
    without --api-key (the key's middleware once hid the disconnect from the route)."""
    server = one_row_server if key else open_one_row_server
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    before = server.metrics()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPTS[0], "max_tokens": 240}), headers=headers)
    assert total(_running(server, 1), "medusa:num_requests_running") == 1, "the request never ran"
    connection.close()  # the client hangs up
    after = _running(server, 0, timeout=10)
    assert total(after, "medusa:num_requests_running") == 0, "the dropped request still holds its row"

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("medusa:requests_finished_total", finish_reason="cancelled") == 1
    assert delta("medusa:requests_finished_total") == 1
    assert delta("medusa:generation_tokens_total") < 240, "the dropped request ran to its end"
    answer = server.client(api_key=key or "unused").completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=20)
    assert answer.choices[0].text == solo(runtime, PROMPTS[4], 20).text


LONG_PROMPT = "Once upon a time there was a big dog. " * 40  # over the engine's 256-token context

BAD = [  # (endpoint, body, status, param, words of the message)
    ("completions", b'{"prompt": "Hi", ', 400, None, "not valid JSON"),
    ("completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("completions", {"prompt": "Hi", "frequency": 1}, 400, "frequency", "unknown field 'frequency'"),
    ("completions", {"max_tokens": 5}, 400, "prompt", "prompt is required"),
    ("completions", {"prompt": ""}, 400, "prompt", "prompt is empty"),
    ("completions", {"prompt": LONG_PROMPT}, 400, "prompt", "context is 256 tokens"),
    ("completions", {"prompt": "Hi", "max_tokens": -4}, 400, "max_tokens", "max_tokens must be >= 1, got -4"),
    ("completions", {"prompt": "Hi", "max_tokens": 1000}, 400, "max_tokens", "at most 25"),
    ("completions", {"prompt": "Hi", "max_tokens": "ten"}, 400, "max_tokens", "valid integer"),
    ("completions", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("completions", {"prompt": "Hi", "temperature": -1.0}, 400, "temperature", "temperature must be >= 0"),
    ("completions", {"prompt": "Hi", "stream": "yes"}, 400, "stream", "valid boolean"),
    ("completions", {"prompt": "Hi", "stop": ["", "x"]}, 400, "stop", "empty string"),
    ("completions", {"prompt": "Hi", "stop": 3}, 400, "stop", "string or a list of strings"),
    ("completions", {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "holds 5 strings: this server takes at most 4"),
    ("completions", {"prompt": "Hi", "stop": ["x" * 600, "y" * 600]}, 400, "stop", "1200 bytes (UTF-8): this server takes at most 1024"),
    ("completions", {"prompt": [1, 10**7]}, 400, "prompt", "token id 10000000"),
    ("completions", {"prompt": ["Hi", "Ho"]}, 400, "prompt", "one request per prompt"),
    ("completions", {"prompt": "Hi", "n": 2}, 400, "n", "n=2"),
    ("completions", {"prompt": "Hi", "logprobs": 2}, 400, "logprobs", "not supported"),
    ("completions", {"prompt": "Hi", "echo": True}, 400, "echo", "not supported"),
    ("completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("chat/completions", {"messages": "Hi"}, 400, "messages", "valid array"),
    ("chat/completions", {"messages": []}, 400, "messages", "messages is empty"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages.0.role", "'system', 'user' or 'assistant'"),
    ("chat/completions", {"messages": [{"role": "user", "content": ""}]}, 400, "messages", "empty prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2}, 400, "n", "n=2"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages", "context is 256 tokens"),
]


def test_bad_requests_get_400s_while_a_long_request_completes(server, runtime):
    running = {}

    def long_request():
        stream = server.client().completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=200, stream=True)
        running["text"] = "".join(c.choices[0].text for c in stream if c.choices)

    worker = threading.Thread(target=long_request)
    worker.start()  # a good request streams while the bad ones come and go
    for endpoint, body, status, param, words in BAD:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        answer = httpx.post(f"{server.url}/v1/{endpoint}", content=content, headers={"Content-Type": "application/json"}, timeout=60)
        error = answer.json()["error"]
        case = f"{endpoint} {body!r:.80}: {answer.status_code} {error}"
        assert answer.status_code == status and error["type"] == "invalid_request_error", case
        assert error["param"] == param and words in error["message"], case
    worker.join(timeout=300)
    assert running["text"] == solo(runtime, PROMPTS[5], 200).text
    too_big = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
    answer = httpx.post(f"{server.url}/v1/completions", content=too_big, headers={"Content-Type": "application/json"}, timeout=60)
    assert answer.status_code == 400 and "larger than" in answer.json()["error"]["message"]
    assert (
        server.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12).choices[0].text
        == solo(runtime, PROMPTS[0], 12).text
    )


# ---------------------------------------------------------------------------------- metrics


def test_metrics_move_by_exactly_the_drafted_and_accepted_tokens(server, runtime):
    """The counters' terms are results.StepDrafts': per verify step, drafted = tree nodes below the
    root, accepted = drafted tokens committed; the runtime's own stats of the same greedy request
    (the engine's fixed drafting budget makes the trees the same) give the expected deltas."""
    prompt, n = PROMPTS[2], 48
    want = solo(runtime, prompt, n)
    drafts = want.stats.drafts
    assert len(drafts) == want.stats.steps and want.stats.accepted_tokens > 0, "the fitted heads accept some drafts"
    assert want.stats.accepted_tokens == sum(want.stats.accepted_per_step) - want.stats.steps  # a step emits accepted + 1
    before = server.metrics()
    assert server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=n).choices[0].text == want.text
    after = server.metrics()

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("medusa:spec_decode_num_drafts_total") == sum(1 for d in drafts if d.drafted)
    assert delta("medusa:spec_decode_num_draft_tokens_total") == want.stats.drafted_tokens
    assert delta("medusa:spec_decode_num_accepted_tokens_total") == want.stats.accepted_tokens
    by_drafter = {}
    for d in drafts:
        for name, drafted, accepted in d.by_drafter:
            by_drafter.setdefault(name, [0, 0])
            by_drafter[name][0] += drafted
            by_drafter[name][1] += accepted
    assert "heads" in by_drafter
    for name, (drafted, accepted) in by_drafter.items():
        assert delta("medusa:spec_decode_num_draft_tokens_total", drafter=name) == drafted, name
        assert delta("medusa:spec_decode_num_accepted_tokens_total", drafter=name) == accepted, name
    assert delta("medusa:generation_tokens_total") == len(want.token_ids)
    assert delta("medusa:prompt_tokens_total") == len(runtime.codec.encode(prompt, chat=False))
    assert delta("medusa:requests_finished_total", finish_reason=want.finish_reason) == 1
    assert delta("medusa:time_to_first_token_seconds_count") == 1 and delta("medusa:e2e_request_latency_seconds_count") == 1
    assert delta("medusa:inter_token_latency_seconds_count") == want.stats.steps  # one interval per verify step
    assert total(after, "medusa:num_requests_running") == 0 and total(after, "medusa:num_requests_waiting") == 0
    assert all(f'model="{MODEL}"' in k for k in after if k.startswith("medusa:"))


# ---------------------------------------------------------------------------------- access, stopping


def test_api_key_and_loopback(one_row_server, engine, tmp_path):
    server = one_row_server
    assert server.url.startswith("http://127.0.0.1:")  # --host defaults to loopback
    listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    assert [row[1] for row in listening if row[3] == "0A" and int(row[1].split(":")[1], 16) == server.port] == [
        f"0100007F:{server.port:04X}"
    ]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=headers, timeout=30)
        assert answer.status_code == 401 and answer.json()["error"]["type"] == "authentication_error", headers
    assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert server.client(api_key=API_KEY).completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    assert httpx.get(f"{server.url}/health", timeout=30).json() == {"status": "ok"}  # health and metrics need no key
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200
    done = subprocess.run(
        [sys.executable, "-m", "medusa_trt.cli.serve", str(engine), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert (
        done.returncode == 2
        and done.stderr.count("\n") == 1
        and "not a loopback address" in done.stderr
        and "--allow-remote" in done.stderr
    )


ERROR_KEYS = {"message", "type", "param", "code"}  # OpenAI's error body


def test_a_loopback_server_answers_only_loopback_host_names(server, open_one_row_server):
    """DNS rebinding: a web page on evil.example whose name is made to resolve to 127.0.0.1 reaches
    the server with ``Host: evil.example``. A loopback server answers only 127.0.0.1, localhost and
    [::1] (any port) on every route, and refuses the rest with a 403 in OpenAI's error shape;
    with --allow-remote any name is served."""
    port, body = server.port, {"prompt": "Hi", "max_tokens": 2}
    foreign = ["evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}", "localhost.evil.example", "[::2]", "::1"]
    for host in foreign:
        for method, path in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
            answer = httpx.request(method, f"{server.url}{path}", headers={"Host": host}, json=body, timeout=30)
            case = f"{method} {path} Host {host!r}: {answer.status_code} {answer.text[:200]}"
            assert answer.status_code == 403 and set(answer.json()["error"]) == ERROR_KEYS, case
            assert "--allow-remote" in answer.json()["error"]["message"], case
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:  # HTTP/1.0 without a Host header
        raw.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert raw.makefile("rb").readline().split()[1] == b"403"
    for host in ("127.0.0.1", f"127.0.0.1:{port}", "localhost", f"LOCALHOST:{port}", f"[::1]:{port}", "[::1]"):
        assert httpx.get(f"{server.url}/v1/models", headers={"Host": host}, timeout=30).status_code == 200, host
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers={"Host": f"localhost:{port}"}, timeout=30).status_code == 200
    remote = open_one_row_server
    assert httpx.get(f"{remote.url}/v1/models", headers={"Host": "evil.example"}, timeout=30).status_code == 200


def test_only_json_bodies_are_taken(server):
    """A browser sends a cross-origin POST without asking first (no CORS preflight) only as text/plain,
    a form or multipart, or a body with no type: each is a 415 in OpenAI's error shape, before the
    body is read. JSON, with or without a charset, is served."""
    content = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    refused = ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None)
    for content_type in refused:
        headers = {"Origin": "http://evil.example"} | ({"Content-Type": content_type} if content_type else {})
        answer = httpx.post(f"{server.url}/v1/completions", content=content, headers=headers, timeout=30)
        error = answer.json()["error"]
        assert answer.status_code == 415 and set(error) == ERROR_KEYS and error["type"] == "invalid_request_error", content_type
        assert "application/json" in error["message"], error
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        answer = httpx.post(f"{server.url}/v1/completions", content=content, headers={"Content-Type": content_type}, timeout=30)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2, content_type


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                found.append(int(entry.name))
    return found


def _shm_of(pid: int) -> set[str]:
    """/dev/shm files a process has mapped or open."""
    found = set()
    try:
        found |= {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/" in line}
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("/dev/shm/"):
                found.add(target)
    except OSError:
        pass
    return found


def _listening(port: int) -> bool:
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return any(row[3] == "0A" and int(row[1].split(":")[1], 16) == port for row in rows)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_stopping_mid_stream_leaves_nothing_behind(engine, tmp_path, how):
    """A stream and a non-streaming request running, then the signal. SIGTERM (``--shutdown-timeout
    0``: no grace, both are still running): the stream ends with an error event, ``data: [DONE]`` and
    its chunked body's terminator, the other request gets a 503 with OpenAI's error body, and the
    process exits 0 within ``END_GRACE_S`` (and its teardown) with no traceback in its log. SIGKILL: nothing
    to clean up. Either way no process of its group, no listening port and no shared-memory file it
    held remain (the server starts no process and keeps no /dev/shm file)."""
    from medusa_trt.serving.openai_server import END_GRACE_S

    server = Server(engine, "--shutdown-timeout", "0", log=tmp_path / "serve.log", slow=True)
    body = {"prompt": PROMPTS[0], "max_tokens": 240}
    whole = {}

    def post():
        try:
            answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            whole["answer"] = answer.status_code, answer.headers["content-type"], answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            whole["answer"] = exc

    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)  # generating
            worker = threading.Thread(target=post)
            worker.start()
            assert total(_running(server, 2), "medusa:num_requests_running") == 2
            shm = _shm_of(server.pid)
            assert _group(server.pid) == [server.pid], "the server runs as one process"
            started = time.monotonic()
            os.kill(server.pid, getattr(signal, how))
            code = server.proc.wait(30)
            stopped = time.monotonic() - started
            try:
                events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
            except httpx.HTTPError as exc:  # cut off: no chunk terminator
                events = exc
        worker.join(60)
        log = server.log.read_text()
        if how == "SIGTERM":
            # bounded: shutdown_timeout (0) + END_GRACE_S, then the process's own teardown (slack for a loaded machine)
            assert code == 0 and stopped < END_GRACE_S + 5, (stopped, log[-2000:])
            assert "medusa-serve: stopped" in log and "Traceback" not in log, log[-3000:]
            assert isinstance(events, list) and events[-1] == "[DONE]", events
            error = json.loads(events[-2])["error"]
            assert set(error) == {"message", "type", "param", "code"} and "shutting down" in error["message"], events[-2]
            status, content_type, answer = whole["answer"]
            assert status == 503 and content_type == "application/json", whole
            assert set(answer["error"]) == {"message", "type", "param", "code"} and "shutting down" in answer["error"]["message"]
        else:
            assert code == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while (_group(server.pid) or _listening(server.port)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _group(server.pid) == [] and not _listening(server.port)
        assert not [s for s in shm if Path(s).exists()], shm
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_sigterm_admits_no_new_work_and_lets_requests_in_flight_finish(engine, tmp_path):
    """SIGTERM with a grace period (--shutdown-timeout 30) while a stream runs: a new connection is
    refused; a request on a keep-alive connection opened before gets a JSON 503 or finds the
    connection closed, never a generation; the stream finishes as it would have ([DONE] after its
    finish_reason), and the process exits 0 with no traceback in its log."""
    server = Server(engine, "--shutdown-timeout", "30", log=tmp_path / "serve.log", slow=True)
    try:
        idle = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        idle.request("GET", "/health")
        assert idle.getresponse().read() == b'{"status":"ok"}'
        body = {"prompt": PROMPTS[0], "max_tokens": 240, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            os.kill(server.pid, signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{server.url}/health", timeout=5)
            try:
                idle.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi"}), headers={"Content-Type": "application/json"})
                answer = idle.getresponse()
                assert answer.status == 503 and "shutting down" in json.loads(answer.read())["error"]["message"]
            except (OSError, http.client.HTTPException):
                pass  # uvicorn closed the idle connection first: refused as well
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")
        assert server.proc.wait(30) == 0
        assert "Traceback" not in server.log.read_text()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_serve_bad_input_is_one_line(engine, tmp_path):
    def serve(*args):
        done = subprocess.run(
            [sys.executable, "-m", "medusa_trt.cli.serve", *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
        assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith("medusa-serve: error: ") and "Traceback" not in done.stderr
        return done.stderr

    assert "missing does not exist: pass an engine" in serve(str(tmp_path / "missing"))
    (tmp_path / "repo").mkdir()
    assert "is not an engine" in serve(str(tmp_path / "repo"), "--api", "openai")
    assert "--port-grpc would be ignored by the OpenAI server" in serve(str(engine), "--port-grpc", "0")
    assert "--api-key would be ignored by a Triton server" in serve(str(tmp_path / "repo"), "--api-key", "k")
    assert "--tree would be ignored by a repository" in serve(str(tmp_path / "repo"), "--tree", "chain-1")
    assert "the engine was exported for" in serve(str(engine), "--max-batch", "64")


# ---------------------------------------------------------------------------------- multi-turn


def test_a_conversation_prompt_goes_through_the_chat_template(runtime, stories_base):
    tokenizer = copy.deepcopy(stories_base.tokenizer)
    tokenizer.chat_template = SERVING_CHAT_TEMPLATE
    expected = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
    assert runtime.codec.encode_chat(CONVERSATION) == expected  # jinja2 + tokenizers, as transformers renders it
    reply = runtime.generate(CONVERSATION, max_new_tokens=24)
    assert reply.token_ids == runtime.generate(expected, max_new_tokens=24).token_ids
    other = CONVERSATION[:2]
    batch = runtime.generate([CONVERSATION, other], max_new_tokens=24)  # a batch of conversations
    assert [r.token_ids for r in batch] == [reply.token_ids, runtime.generate(other, max_new_tokens=24).token_ids]
    assert [e.text for e in runtime.stream(CONVERSATION, max_new_tokens=24)] and "".join(
        e.text for e in runtime.stream(CONVERSATION, max_new_tokens=24)
    ) == reply.text
    with pytest.raises(PromptError, match="message 1 has role 'robot'"):
        runtime.generate([CONVERSATION[0], {"role": "robot", "content": "Hi"}], max_new_tokens=4)
    with pytest.raises(PromptError, match="drop chat_template=False"):
        runtime.generate(CONVERSATION, max_new_tokens=4, chat_template=False)
    with pytest.raises(PromptError, match="message 0 .*empty prompt"):
        runtime.generate([{"role": "user", "content": ""}], max_new_tokens=4)


def test_medusa_run_messages(engine, runtime, tmp_path, capsys):
    from medusa_trt.cli.run import main as run_main

    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": CONVERSATION}))
    assert run_main(["--engine", str(engine), "--messages", str(chat), "--max-new-tokens", "20", "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["token_ids"] == runtime.generate(CONVERSATION, max_new_tokens=20).token_ids
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "user"}]))
    assert run_main(["--engine", str(engine), "--messages", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "message 0 must be a dict with exactly the keys 'role' and 'content'" in err
    assert run_main(["--engine", str(engine), "--messages", str(chat), "--no-chat-template"]) == 2
    assert "drop --no-chat-template" in capsys.readouterr().err
