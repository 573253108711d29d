"""--speculative-config with a draft model through the real server: greedy answers identical to a server without
it (chat and completions, streamed or not, n > 1, logprobs, stop strings); the demo drafting for itself accepts
nearly every token; a draft whose vocabulary differs or that does not exist stops start-up in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.e2e.conftest import Server, start_server
from tests.e2e.sse import events
from tests.e2e.test_speculative import BODIES, TEXT, answers, close, post, streamed


def noisy_copy(src: Path, dst: Path) -> Path:
    """`src` with noise in its MLPs: a draft that agrees with it often, not always."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if "mlp" in name:
            weights[name] = w + 0.5 * w.std() * torch.randn(w.shape, generator=gen)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def spec(draft: Path, k: int = 4) -> str:
    return json.dumps({"model": str(draft), "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, Server]]:
    from demo.checkpoints import demo_checkpoint_path

    model: Path = demo_checkpoint_path()
    tmp = tmp_path_factory.mktemp("draft")
    noisy = noisy_copy(model, tmp / "noisy")
    plain = start_server(model, tmp)
    free = {"SPINDLE_SPEC_DRAFT_COST": "0"}  # the demo's draft costs what it does: draft anyway, to check the path
    selfdraft = start_server(model, tmp, "--speculative-config", spec(model), env=free)
    other = start_server(model, tmp, "--speculative-config", spec(noisy, 3), env=free)
    yield plain, selfdraft, other
    for s in (plain, selfdraft, other):
        s.stop()


def streamed_chat(server: Server, body: dict[str, object]) -> tuple[str, str | None]:
    text, reason = "", None
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={"model": "tiny", "stream": True, **body}, timeout=120
    ) as r:
        for event in events(r):
            for c in event["choices"]:
                text += c["delta"].get("content") or ""
                reason = c["finish_reason"] or reason
    return text, reason


def test_same_answers_with_and_without(servers: tuple[Server, Server, Server]) -> None:
    plain, *drafted = servers
    chat = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 30, "temperature": 0}
    free = {"prompt": "Write about rivers.", "max_tokens": 30, "temperature": 0, "n": 3}
    for server in drafted:
        for path, body in [*BODIES, ("/v1/completions", free)]:
            got = post(server, path, body)
            want = post(plain, path, body)
            assert close(answers(got), answers(want)), (server.args, path, body)
            counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached tokens follow earlier posts
            assert [got["usage"][c] for c in counts] == [want["usage"][c] for c in counts]  # type: ignore[index]
        body = {"prompt": TEXT, "max_tokens": 40, "temperature": 0}
        assert streamed(server, body) == streamed(plain, body)
        assert streamed_chat(server, chat) == streamed_chat(plain, chat)
        assert server.metric("spindle_spec_decode_num_drafts_total") > 0
    other = drafted[1]
    assert (
        0
        < other.metric("spindle_spec_decode_num_accepted_tokens_total")
        < other.metric("spindle_spec_decode_num_draft_tokens_total")
    )


def test_self_draft_accepts_nearly_every_token(servers: tuple[Server, Server, Server]) -> None:
    _, selfdraft, _ = servers
    post(selfdraft, "/v1/completions", {"prompt": "Count with me:", "max_tokens": 60, "temperature": 0})
    drafted = selfdraft.metric("spindle_spec_decode_num_draft_tokens_total")
    accepted = selfdraft.metric("spindle_spec_decode_num_accepted_tokens_total")
    assert drafted >= 20 and accepted / drafted >= 0.9, (accepted, drafted)
    assert selfdraft.metric("spindle_spec_decode_num_accepted_tokens_per_pos_total", 'position="0"') > 0


def start_fails(*args: str) -> str:
    """`spindle serve ...` that must not start: exit status 2 and one line on stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "server", *args, "--port", "1"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_bad_drafts_stop_start_up(tmp_path: Path) -> None:
    from demo.checkpoints import demo_checkpoint_path, make_demo

    model = str(demo_checkpoint_path())
    llama = make_demo(tmp_path / "llama", "llama")  # a 32,000-token tokenizer
    line = start_fails("--model", model, "--speculative-config", spec(llama))
    assert "vocabulary does not match" in line and "151665 tokens, the draft's 32000" in line
    line = start_fails("--model", model, "--speculative-config", spec(tmp_path / "none"))
    assert "--speculative-config" in line and "does not exist" in line


def test_client_gone_mid_stream(servers: tuple[Server, Server, Server]) -> None:
    """Streams closed after a few chunks (their requests aborted between verifications); the server answers on."""
    plain, selfdraft, _ = servers
    body = {"model": "tiny", "prompt": TEXT, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    for _ in range(3):
        with httpx.stream("POST", f"{selfdraft.url}/v1/completions", json=body, timeout=120) as r:
            for n, _event in enumerate(events(r)):
                if n == 3:
                    break
    short = {"prompt": TEXT, "max_tokens": 40, "temperature": 0}
    assert streamed(selfdraft, short) == streamed(plain, short)
