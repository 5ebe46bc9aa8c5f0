"""A teacher behind any OpenAI-compatible server: the self-distillation continuations written by
vLLM, SGLang, TGI, TensorRT-LLM's ``trtllm-serve`` or ``medusa-serve`` serving the base model.

``medusa-train --teacher URL`` sends each prompt of the pool (and the follow-ups) as token ids, the
same ids the local runtime would decode from, to ``POST {URL}/completions`` (greedy, ``max_tokens``
= ``--new-tokens``), ``--teacher-concurrency`` requests in flight per rank, and appends each answer
to the rank's sequences file as it arrives: a server that dies mid-run loses nothing written, and
the rerun asks only for what is missing.

The token ids are the model's own:
  * from the server where it gives them: ``"return_token_ids": true`` (vLLM's extension, which
    medusa-serve serves too) returns ``choices[0].token_ids``; a server that refuses the field is
    asked without it;
  * else from ``logprobs.tokens`` written as ``token_id:N`` (vLLM's ``--return-tokens-as-token-ids``);
  * else the text is tokenized again and kept only when it round-trips: the ids decode to the text
    and their count is the server's ``usage.completion_tokens`` (one more when the model stopped on
    its end-of-sequence token, which the text leaves out). Samples that do not are dropped and counted.

Before any work, ``Teacher.connect`` reads ``GET /models`` (an unreachable or non-OpenAI URL is one
line) and ``check_tokenizer`` sends a probe text: the server must count (or return) the tokens
``--model``'s tokenizer makes of it, else it serves another model (one line).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from medusa_trt.training.config import GENERATE_CONTEXT, TrainConfig, TrainError

log = logging.getLogger(__name__)

# a probe of the tokenizer: words, digits, punctuation, an accented word and a long rare one
PROBE = "Once upon a time, in 1987, Zoë's café served 42 crêpes; a tokenizer's counterintuitiveness shows here."
TIMEOUT_S = 600.0  # one request: a long continuation on a loaded server


class TeacherError(TrainError):
    """The teacher cannot be used as given."""


@dataclass
class Teacher:
    url: str  # the base URL, ending in /v1
    model: str  # the model id the server lists
    concurrency: int = 8
    token_ids: bool = True  # the server takes "return_token_ids" (vLLM's extension)
    dropped: int = field(default=0)  # samples whose text did not round-trip
    context: int | None = None  # the positions the server serves (its model's max_model_len in GET /models; None: not said)

    @classmethod
    def connect(cls, url: str, concurrency: int = 8) -> Teacher:
        """The server at ``url`` (``http://host:port`` or ``.../v1``), its model and context (``max_model_len``, as
        vLLM and ``medusa-serve`` list it) read from ``GET /models``."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise TeacherError(f"--teacher {url} is not an http(s) URL: pass the server's base URL, e.g. http://127.0.0.1:8000/v1")
        base = url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        teacher = cls(base, "", concurrency)
        listing = teacher._call("GET", "/models", None, timeout=30)
        models = listing.get("data") if isinstance(listing, dict) else None
        if not (isinstance(models, list) and models and isinstance(models[0], dict) and isinstance(models[0].get("id"), str)):
            raise TeacherError(f"--teacher {url}: GET {base}/models lists no model; is it an OpenAI-compatible server?")
        teacher.model = models[0]["id"]
        length = models[0].get("max_model_len")
        teacher.context = length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
        return teacher

    def _call(self, method: str, path: str, body: dict | None, *, timeout: float = TIMEOUT_S) -> dict:
        """One request; a network or HTTP failure is a TeacherError naming the server and what to do."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method, headers={"Content-Type": "application/json"})
        where = f"--teacher {self.url}: {method} {path}"
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = _error_message(exc.read())
            raise TeacherError(f"{where} answered HTTP {exc.code}{': ' + detail if detail else ''}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TeacherError(
                f"{where} failed ({reason}): start the server, or check the URL (its base, e.g. http://host:8000/v1)"
            ) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise TeacherError(f"{where} did not answer JSON: is it an OpenAI-compatible server?") from None

    def _complete(self, prompt, max_tokens: int) -> dict:
        """One greedy completion of ``prompt`` (token ids or text): the first choice with the usage."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if self.token_ids:
            body["return_token_ids"] = True
        try:
            answer = self._call("POST", "/completions", body)
        except TeacherError as exc:
            if not (self.token_ids and "return_token_ids" in str(exc)):
                raise
            self.token_ids = False  # a server without vLLM's extension: its text is tokenized again
            log.info("%s does not return token ids: its text is tokenized again, with a round-trip check", self.url)
            return self._complete(prompt, max_tokens)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
            raise TeacherError(f"--teacher {self.url}: POST /completions answered no choices: is it an OpenAI-compatible server?")
        first = choices[0]
        return first | {
            "usage": answer.get("usage") or {},
            "prompt_token_ids": first.get("prompt_token_ids") or answer.get("prompt_token_ids"),
        }

    def check_tokenizer(self, base) -> None:
        """Refuse a server of another model: the tokens it makes of ``PROBE`` must be ``--model``'s (its leading
        words only, where the server's context is too short for all of it and one new token)."""
        words = PROBE.split(" ")
        while len(words) > 1 and self.context is not None and len(base.tokenizer(" ".join(words))["input_ids"]) >= self.context:
            words.pop()
        probe = " ".join(words)
        mine = base.tokenizer(probe)["input_ids"]
        choice = self._complete(probe, 1)
        theirs = choice.get("prompt_token_ids")
        count = (choice["usage"] or {}).get("prompt_tokens")
        if isinstance(theirs, list):
            same = theirs == mine
            what = f"other token ids for a probe text than --model's ({len(theirs)} vs {len(mine)} tokens)"
        elif isinstance(count, int):
            same = count == len(mine)
            what = f"{count} tokens of a probe text where --model's tokenizer makes {len(mine)}"
        else:
            raise TeacherError(f"--teacher {self.url} reports no prompt token count (usage.prompt_tokens): its tokenizer cannot be checked")
        if not same:
            raise TeacherError(f"--teacher {self.url} serves another model ({self.model}): its tokenizer makes {what}; serve --model there")

    def continuation(self, base, prompt_ids: list[int], max_tokens: int) -> list[int] | None:
        """The model's own greedy token ids after ``prompt_ids``; None when they cannot be known
        (the text does not round-trip)."""
        choice = self._complete(prompt_ids, max_tokens)
        ids = choice.get("token_ids")
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            return ids
        tokens = (choice.get("logprobs") or {}).get("tokens") if isinstance(choice.get("logprobs"), dict) else None
        if isinstance(tokens, list) and tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            return [int(t.removeprefix("token_id:")) for t in tokens]
        return retokenized(base, choice)


def retokenized(base, choice: dict) -> list[int] | None:
    text, count = choice.get("text"), (choice.get("usage") or {}).get("completion_tokens")
    if not isinstance(text, str):
        return None
    ids = base.tokenizer(text, add_special_tokens=False)["input_ids"]
    if base.tokenizer.decode(ids) != text:
        return None
    if count == len(ids) + 1 and choice.get("finish_reason") == "stop" and base.eos_token_ids:
        ids = ids + [base.eos_token_ids[0]]  # the end-of-sequence token the text leaves out
    return ids if count in (None, len(ids)) else None


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("message") or body.get("detail")
    except (ValueError, AttributeError):
        message = raw[:200].decode("utf-8", "replace")
    return " ".join(str(message or "").split())


def generate_with_teacher(base, config: TrainConfig, todo: list, open_sink, done: dict) -> None:
    """The continuations of ``todo`` ((key, prompt text or conversation) pairs) from the teacher,
    ``config.teacher_concurrency`` at a time, each record appended as it arrives (``open_sink()``
    gives this rank's writer). Prompts are encoded as the local runtime would (chat template when
    the model has one and ``config.chat_template``); a prompt that leaves no room for
    ``new_tokens`` in the generating context is skipped, as there: the model's positions (at most
    ``GENERATE_CONTEXT``), or the server's context where it is shorter (an engine served with a
    short ``max_context``), so one overlong prompt never stops the run with an HTTP 400."""
    from medusa_trt.runtime.text import TextCodec

    teacher = Teacher.connect(config.teacher, config.teacher_concurrency)
    codec = TextCodec(base.tokenizer)
    chat = config.chat_template and base.is_chat and codec.has_chat_template
    context = min(GENERATE_CONTEXT, getattr(base.model.config, "max_position_embeddings", None) or GENERATE_CONTEXT)
    limit = "the generating context"
    if teacher.context is not None and teacher.context < context:
        context, limit = teacher.context, "the server's max_model_len"
    encoded = [(k, codec.encode(p, chat=chat) if isinstance(p, str) else codec.encode_chat(p)) for k, p in todo]
    kept = [(k, ids) for k, ids in encoded if len(ids) <= context - config.new_tokens]
    if len(kept) < len(encoded):
        log.warning(
            "%d prompts leave no room for %d new tokens in %d positions (%s): skipped",
            len(encoded) - len(kept),
            config.new_tokens,
            context,
            limit,
        )
    sink, new_tokens, started = None, 0, time.perf_counter()
    with ThreadPoolExecutor(teacher.concurrency) as pool, tqdm(total=len(kept), desc="teacher", unit="seq", disable=None) as bar:
        futures = {pool.submit(teacher.continuation, base, ids, config.new_tokens): (key, ids) for key, ids in kept}
        try:
            for future in as_completed(futures):  # each written as it finishes
                (kind, index), ids = futures[future]
                answer = future.result()
                bar.update()
                if answer is None:
                    teacher.dropped += 1
                    continue
                sink = sink or open_sink()
                sink.write_records([{kind: index, "ids": ids + answer, "start": len(ids)}], done)
                new_tokens += len(answer)
                bar.set_postfix(new_tokens_per_s=f"{new_tokens / (time.perf_counter() - started):.0f}")
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    if teacher.dropped:
        log.warning(
            "%d of %d teacher answers dropped: their text does not round-trip through --model's tokenizer", teacher.dropped, len(kept)
        )
