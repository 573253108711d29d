"""The render workers' guards: a scrubbed environment, (de)tokenizing under the templates' time limit and
memory cap, and the max_model_len bound checked before a text is tokenized (server/request/prompt_tokens.py).

Real tokenizers and real worker processes, on Trio and asyncio.
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import tokenizers

from demo.tokenizers import tokenizer_dir
from server.http.errors import APIError
from server.render.renderer import Renderer, RenderError
from server.render.worker_pool import worker_env
from server.request.input_processor import ModelLimits, check_fits, max_token_bytes
from server.request.prompt_tokens import text_prompt_ids

REPO = Path(__file__).resolve().parents[3]
SECRETS = {
    "HF_TOKEN": "hf_s3cret1",
    "HUGGING_FACE_HUB_TOKEN": "hf_s3cret2",
    "SPINDLE_API_KEY": "sk-s3cret3",
    "SPINDLE_API_KEYS": "sk-s3cret4,sk-s3cret5",
    "OPENAI_API_KEY": "sk-s3cret6",
    "AWS_SECRET_ACCESS_KEY": "s3cret7",
    "DATABASE_PASSWORD": "s3cret8",
    "GITHUB_TOKEN": "s3cret9",
    "SOME_SERVICE_KEY": "s3cret10",
}
BIG = "数据 hello world, " * 150_000  # ~3 MB: seconds and hundreds of MB to tokenize


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@functools.cache
def fast(family: str) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tokenizer_dir(family) / "tokenizer.json"))  # type: ignore[arg-type]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_worker_env_keeps_only_what_python_needs() -> None:
    env = worker_env(
        {
            "PATH": "/bin",
            "HOME": "/h",
            "LANG": "C.UTF-8",
            "LC_CTYPE": "C",
            "PYTHONPATH": "/p",
            "TMPDIR": "/t",
            "HF_HOME": "/hf",
            "TOKENIZERS_PARALLELISM": "true",
            **SECRETS,
        }
    )
    assert env == {"PATH": "/bin", "HOME": "/h", "LANG": "C.UTF-8", "LC_CTYPE": "C", "PYTHONPATH": "/p", "TMPDIR": "/t"}


@pytest.mark.anyio
async def test_workers_start_without_the_servers_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    async with Renderer.open(tokenizer_dir("qwen2"), num_workers=2) as r:
        probe = "hello world " * 100  # long enough to go to a worker
        for _ in range(2):
            assert await r.encode(probe) == fast("qwen2").encode(probe).ids  # they work without them
        assert len(r.worker_pids) == 2
        for pid in r.worker_pids:
            env = _environ(pid)
            assert not SECRETS.keys() & env.keys()
            assert not [v for v in env.values() if any(s in v for s in SECRETS.values())]
            assert env["PATH"] == os.environ["PATH"] and env["LC_ALL"] == "C.UTF-8"
            assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)


@pytest.mark.anyio
async def test_tokenizing_past_the_time_limit_is_stopped_and_the_worker_replaced() -> None:
    async with Renderer.open(tokenizer_dir("qwen2"), tokenize_timeout=0.5) as r:
        (pid,) = r.worker_pids
        with pytest.raises(RenderError, match=r"tokenizing the text took longer than 0.5 s and was stopped"):
            await r.encode(BIG)
        assert not os.path.exists(f"/proc/{pid}")  # killed and reaped: it burns no CPU
        probe = "hello world " * 100
        assert await r.encode(probe) == fast("qwen2").encode(probe).ids  # on a fresh worker
        assert r.worker_pids != [pid]


@pytest.mark.anyio
async def test_tokenizing_past_the_memory_cap_is_refused_and_the_worker_usable() -> None:
    async with Renderer.open(tokenizer_dir("qwen2"), memory_limit=64 << 20) as r:
        with pytest.raises(RenderError, match="memory limit"):
            await r.encode(BIG)
        # The tokenizer aborts its process when an allocation fails: a fresh worker serves the next request.
        probe = "数据 hello world, " * 1000
        assert await r.encode(probe) == fast("qwen2").encode(probe).ids
        ids = fast("qwen2").encode(probe).ids
        assert await r.decode(ids) == probe


class _CountingRenderer:
    """A Renderer whose encode calls are counted."""

    def __init__(self, renderer: Renderer) -> None:
        self._renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.encodes = 0

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encodes += 1
        return await self._renderer.encode(text, add_special_tokens)


@pytest.fixture
async def counting(anyio_backend: str) -> AsyncIterator[_CountingRenderer]:
    async with Renderer.open(tokenizer_dir("qwen2")) as r:
        yield _CountingRenderer(r)


def _text_of_bytes(n: int, wide: bool) -> str:
    """A text of exactly n UTF-8 bytes: ASCII, or mostly 3-byte CJK (the bound counts bytes, not characters)."""
    return "数" * (n // 3) + "a" * (n % 3) if wide else "a" * n


@pytest.mark.anyio
@pytest.mark.parametrize("wide", [False, True])
async def test_text_that_cannot_fit_max_model_len_is_refused_before_tokenizing(
    counting: _CountingRenderer, wide: bool
) -> None:
    limits = ModelLimits(max_model_len=64, vocab_size=151_646)
    per = 3 * max_token_bytes(counting.tokenizer)  # text bytes one token may cover at most (admission.min_tokens)
    # Just under: the bound (max_model_len - 1 tokens) leaves room for output, so the text is tokenized.
    under = _text_of_bytes(per * (limits.max_model_len - 1), wide)
    assert await text_prompt_ids(counting, under, True, "messages", limits=limits) == fast("qwen2").encode(under).ids
    assert counting.encodes == 1
    # At (exactly max_model_len tokens at least) and just over: refused, never tokenized.
    for n, lower in [(per * (limits.max_model_len - 1) + 1, 64), (per * limits.max_model_len + 1, 65)]:
        with pytest.raises(APIError) as info:
            await text_prompt_ids(counting, _text_of_bytes(n, wide), True, "messages", limits=limits)
        assert info.value.status == 400 and info.value.param == "messages"
        assert "max_model_len) is 64 tokens" in info.value.message and f"at least {lower} input" in info.value.message
    assert counting.encodes == 1
    # Without limits (/tokenize, or a prompt truncate_prompt_tokens cuts) any length is tokenized.
    over = _text_of_bytes(per * limits.max_model_len + 1, wide)
    assert len(await text_prompt_ids(counting, over, True)) > 0
    assert counting.encodes == 2


def test_check_fits_at_the_bound() -> None:
    limits = ModelLimits(max_model_len=10, vocab_size=100)
    check_fits(9, limits)  # one token of room for output
    for lower in (10, 11):
        with pytest.raises(APIError, match="max_model_len"):
            check_fits(lower, limits, "prompt")
