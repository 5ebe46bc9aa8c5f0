"""How requests to the OpenAI server end when clients hang up and when the server is stopped (not a test).

    .venv/bin/python scripts/serve_ending.py --engine build/smollm2-135m-medusa [--api-key KEY] [--json out.json]

Starts ``medusa-serve ENGINE --port 0`` on loopback (twice: one server per part) and measures:

1. Dropped requests. One non-streaming request of ``--probe-tokens`` alone (its latency, the
   median of 3: the baseline); then ``--drops`` non-streaming requests of ``--drop-tokens`` whose clients close the
   connection ``--drop-after`` seconds after sending; then the same probe request again. Reports
   both probe latencies, the running / waiting gauges right after the drops, and how the dropped
   requests ended (``medusa:requests_finished_total`` by finish_reason, once the server is idle).
2. SIGTERM under load. ``--streams`` streaming and ``--whole`` non-streaming requests of
   ``--load-tokens`` each (more than the engine's rows: some wait), SIGTERM once every stream has
   its first event. Reports what each client got (streams: an error event, ``data: [DONE]``, the
   chunked body's terminator; the others: status, content type, OpenAI error body), the seconds
   from SIGTERM to the process's exit, its exit status, and the tracebacks in its log.

Clients are ``http.client`` (a missing chunk terminator raises ``IncompleteRead``), so nothing
is hidden by a client library's retries or parsing.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPT = "1, 2, 3, 4, 5, 6, 7,"  # greedy: the demo engine counts on to max_tokens (finish_reason length), no early EOS


class Server:
    """One ``medusa-serve ENGINE --port 0`` process, stopped by its pid."""

    def __init__(self, engine: str, args: list[str], log: Path):
        self.log = log
        cmd = [sys.executable, "-m", "medusa_trt.cli.serve", engine, "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, start_new_session=True)  # noqa: SIM115
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout] + [lines.put(None)], daemon=True).start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                raise SystemExit(f"medusa-serve exited with {self.proc.wait()}: {log.read_text()[-2000:]}")
            if match := re.search(r"http://([\d.]+):(\d+)/v1", line):
                self.host, self.port = match.group(1), int(match.group(2))
                return
        self.proc.kill()
        raise SystemExit(f"medusa-serve did not start: {log.read_text()[-2000:]}")

    def connection(self, timeout: float = 300) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def headers(api_key: str | None) -> dict:
    return {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})


def completion(server: Server, api_key: str | None, max_tokens: int, stream: bool = False) -> tuple[http.client.HTTPConnection, float]:
    """(connection, start time) of a sent completions request (greedy, ``max_tokens`` new tokens)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    connection = server.connection()
    started = time.monotonic()
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers=headers(api_key))
    return connection, started


def metrics(server: Server) -> dict[str, float]:
    connection = server.connection(30)
    connection.request("GET", "/metrics")
    out = {}
    for line in connection.getresponse().read().decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    connection.close()
    return out


def gauge(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k.partition("{")[0] == name)


def finished(m: dict[str, float]) -> dict[str, float]:
    """requests_finished_total by finish_reason."""
    out = {}
    for k, v in m.items():
        if k.startswith("medusa:requests_finished_total{"):
            out[re.search(r'finish_reason="(\w+)"', k).group(1)] = v
    return out


def probe(server: Server, api_key: str | None, tokens: int) -> tuple[float, str]:
    connection, started = completion(server, api_key, tokens)
    answer = json.loads(connection.getresponse().read())
    connection.close()
    return time.monotonic() - started, answer["choices"][0]["finish_reason"]


def dropped_requests(args, log: Path) -> dict:
    server = Server(args.engine, ["--api-key", args.api_key] if args.api_key else [], log)
    try:
        probe(server, args.api_key, 4)  # warm-up
        alone = sorted(probe(server, args.api_key, args.probe_tokens)[0] for _ in range(3))[1]  # the median of 3
        before = finished(metrics(server))
        for _ in range(args.drops):
            connection, _ = completion(server, args.api_key, args.drop_tokens)
            time.sleep(args.drop_after)
            connection.close()  # the client hangs up before the answer
        time.sleep(0.5)
        m = metrics(server)
        load = {"running": gauge(m, "medusa:num_requests_running"), "waiting": gauge(m, "medusa:num_requests_waiting")}
        after_drops, reason = probe(server, args.api_key, args.probe_tokens)
        deadline = time.monotonic() + args.idle_timeout
        while time.monotonic() < deadline:
            m = metrics(server)
            if gauge(m, "medusa:num_requests_running") + gauge(m, "medusa:num_requests_waiting") == 0:
                break
            time.sleep(0.5)
        after = finished(m)
        ended = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
        ended[reason] = ended.get(reason, 0) - 1  # the probe after the drops
        return {
            "probe_tokens": args.probe_tokens,
            "probe_alone_s": round(alone, 2),
            "probe_after_drops_s": round(after_drops, 2),
            "load_after_drops": load,
            "dropped_ended_as": {k: v for k, v in ended.items() if v},
        }
    finally:
        server.stop()


def read_stream(connection: http.client.HTTPConnection, first: threading.Event, out: dict) -> None:
    try:
        response = connection.getresponse()
        out["status"] = response.status
        raw = response.read1(65536)
        first.set()
        try:
            raw += response.read()
            out["terminator"] = True
        except http.client.IncompleteRead as exc:
            raw += exc.partial
            out["terminator"] = False
        events = [e.removeprefix("data: ") for e in raw.decode(errors="replace").split("\n\n") if e]
        out["events"] = len(events)
        out["done"] = bool(events) and events[-1] == "[DONE]"
        out["error_event"] = any('"error"' in e for e in events[-2:])
    except (OSError, http.client.HTTPException) as exc:
        out["failure"] = f"{type(exc).__name__}: {exc}"
    finally:
        first.set()


def read_whole(connection: http.client.HTTPConnection, out: dict) -> None:
    try:
        response = connection.getresponse()
        body = response.read()
        out["status"], out["content_type"] = response.status, response.getheader("content-type")
        try:
            error = json.loads(body).get("error") or {}
            out["openai_error"] = set(error) == {"message", "type", "param", "code"}
            out["message"] = error.get("message")
        except ValueError:
            out["openai_error"], out["body"] = False, body[:80].decode(errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        out["failure"] = f"{type(exc).__name__}: {exc}"


def sigterm_under_load(args, log: Path) -> dict:
    extra = ["--shutdown-timeout", str(args.shutdown_timeout)] + (["--api-key", args.api_key] if args.api_key else [])
    server = Server(args.engine, extra, log)
    streams = [{} for _ in range(args.streams)]
    whole = [{} for _ in range(args.whole)]
    firsts, threads = [], []
    for out in streams:
        connection, _ = completion(server, args.api_key, args.load_tokens, stream=True)
        firsts.append(threading.Event())
        threads.append(threading.Thread(target=read_stream, args=(connection, firsts[-1], out)))
    for out in whole:
        connection, _ = completion(server, args.api_key, args.load_tokens)
        threads.append(threading.Thread(target=read_whole, args=(connection, out)))
    for t in threads:
        t.start()
    for event in firsts:
        event.wait(120)
    time.sleep(0.3)
    started = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)
    try:
        code = server.proc.wait(120)
    except subprocess.TimeoutExpired:
        server.stop()
        code = "killed after 120 s"
    exit_s = time.monotonic() - started
    for t in threads:
        t.join(30)
    text = log.read_text()
    return {
        "shutdown_timeout_s": args.shutdown_timeout,
        "exit_s": round(exit_s, 2),
        "exit_status": code,
        "tracebacks_in_log": text.count("Traceback"),
        "streams": streams,
        "non_streaming": whole,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--api-key", help="run the servers with --api-key (the clients send it)")
    p.add_argument("--drops", type=int, default=8)
    p.add_argument("--drop-tokens", type=int, default=512)
    p.add_argument("--drop-after", type=float, default=0.3, help="seconds between sending a dropped request and hanging up")
    p.add_argument("--probe-tokens", type=int, default=32)
    p.add_argument("--idle-timeout", type=float, default=300, help="most seconds to wait for the dropped requests to end")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--whole", type=int, default=4)
    p.add_argument("--load-tokens", type=int, default=512)
    p.add_argument("--shutdown-timeout", type=float, default=2.0)
    p.add_argument("--json", help="also write the figures there")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = {
            "dropped": dropped_requests(args, Path(tmp) / "drop.log"),
            "sigterm": sigterm_under_load(args, Path(tmp) / "sigterm.log"),
        }
        report["sigterm_log_tail"] = (Path(tmp) / "sigterm.log").read_text()[-1500:]
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
