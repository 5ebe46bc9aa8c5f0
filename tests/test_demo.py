"""medusa-demo (what ``make demo`` runs) on a tiny engine: its output's structure, the drafted = plain check, bad input."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from medusa_trt.cli.demo import main
from medusa_trt.runtime import MedusaRuntime

PROMPTS = {
    "prompts": [
        {"name": "story", "prompt": "Once upon a time"},
        {"name": "dog", "prompt": "The little dog was sad because"},
        {"name": "chat", "stream": True, "messages": [{"role": "user", "content": "Tell me about Lily."}]},
    ]
}
PER_PROMPT = re.compile(r"^  \d+ tokens in \d+ steps: \d+\.\d\d tokens/step, \d+\.\d\dx plain; (drafted = plain|DRAFTED != PLAIN)$")
TOTAL = re.compile(r"^all 3 prompts: \d+ tokens in \d+ steps, (\d+\.\d\d) tokens/step; [\d.]+ tokens/s drafted vs [\d.]+ plain: \d+\.\d\dx")


def _demo(engine, tmp_path, prompts=PROMPTS) -> int:
    file = tmp_path / "prompts.json"
    file.write_text(json.dumps(prompts))
    return main(["--engine", str(engine), "--prompts", str(file), "--max-new-tokens", "24", "--threads", "1"])


def test_prints_each_answer_then_the_totals(stories_chat_engine, tmp_path, capsys):
    code = _demo(stories_chat_engine, tmp_path)
    out = capsys.readouterr().out.splitlines()
    assert code == 0, out
    headers = [line for line in out if line.startswith("[")]
    assert headers == ["[1/3] story", "[2/3] dog", "[3/3] chat (streamed)"]
    shown = out[out.index("[1/3] story") + 1]
    assert shown.startswith("  | "), out  # the answer's first line
    figures = [line for line in out if line.startswith("  ") and " tokens in " in line]
    assert len(figures) == 3 and all(PER_PROMPT.match(line) and line.endswith("drafted = plain") for line in figures), figures
    streamed = out[out.index("[3/3] chat (streamed)") + 1]
    assert streamed.strip() and not streamed.startswith("  |"), out  # streamed text, not the quoted first lines
    total = next(line for line in out if line.startswith("all 3 prompts"))
    assert TOTAL.match(total), total
    assert float(TOTAL.match(total).group(1)) >= 1.0
    assert out[-1] == "drafted output = plain output on 3/3 prompts, token for token"


def test_a_drafted_output_unlike_plain_is_reported(stories_chat_engine, tmp_path, capsys, monkeypatch):
    """The identity check is real: a plain run that returns one token more makes every prompt differ, exit 1."""
    plain = MedusaRuntime.plain

    def off_by_one(self):
        runtime = plain(self)
        generate = runtime.generate

        def longer(prompt, **kw):
            r = generate(prompt, **kw)
            return dataclasses.replace(r, token_ids=[*r.token_ids, 0]) if kw.get("max_new_tokens") == 24 else r

        runtime.generate = longer
        return runtime

    monkeypatch.setattr(MedusaRuntime, "plain", off_by_one)
    code = _demo(stories_chat_engine, tmp_path)
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert sum(line.endswith("DRAFTED != PLAIN") for line in out) == 3, out
    assert out[-1].startswith("drafted output differs from plain on 3/3 prompts (story, dog, chat)"), out


@pytest.mark.parametrize(
    "prompts, message",
    [
        ({"prompts": []}, '"prompts" must be a non-empty list'),
        ({"items": []}, 'is not {"prompts"'),
        ({"prompts": [{"name": "a"}]}, 'exactly one of "prompt" (text) or "messages"'),
        ({"prompts": [{"name": "a", "prompt": " "}]}, '"prompt" must be non-empty text'),
        ({"prompts": [{"name": "a", "messages": []}]}, "non-empty list of {'role', 'content'} messages"),
        ({"prompts": [{"name": "a", "prompt": "x", "stream": True}, {"name": "b", "prompt": "y", "stream": True}]}, "at most one"),
    ],
)
def test_a_bad_prompts_file_is_one_line_before_the_engine_loads(tmp_path, capsys, prompts, message):
    code = _demo(tmp_path / "no-engine", tmp_path, prompts)  # no engine there: the file is checked first
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("medusa-demo: error: --prompts ") and message in err[0], err


def test_the_shipped_prompts_read():
    """make demo's own file: one prompt of each kind, names unique, one of them streamed."""
    from pathlib import Path

    from medusa_trt.bench.demo import read_demo_prompts

    prompts = read_demo_prompts(str(Path(__file__).resolve().parents[1] / "assets" / "demo_prompts.json"))
    names = [p.name for p in prompts]
    assert len(set(names)) == len(names) >= 4 and {"code", "summary", "question", "chat"} <= set(names)
    assert sum(p.stream for p in prompts) == 1
    assert any(isinstance(p.prompt, list) for p in prompts)  # the chat turn is a conversation
