"""Renderer against transformers' apply_chat_template and the tokenizer itself, on Trio and asyncio.

Real tokenizer folders (demo/tokenizers.py), real templates; the workers are real processes.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import tokenizers

from demo.tokenizers import MISTRAL_CHAT_TEMPLATE, tokenizer_dir
from server.render.renderer import Renderer, RenderError, load_chat_template
from tests.helpers.processes import alive, wait_gone

pytestmark = pytest.mark.anyio
TIMEOUT = 2.0  # render_timeout of the shared renderers: far above a normal render, short enough for tests
RUNAWAY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # 10**10 steps


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
async def qwen(anyio_backend: str) -> AsyncIterator[Renderer]:
    async with Renderer.open(
        tokenizer_dir("qwen2"),
        num_workers=2,
        render_timeout=TIMEOUT,
        trust_request_chat_template=True,
        default_chat_template_kwargs={"greeting": "default"},
        memory_limit=256 << 20,
    ) as r:
        yield r


@pytest.fixture(scope="module")
async def llama(anyio_backend: str) -> AsyncIterator[Renderer]:
    async with Renderer.open(tokenizer_dir("llama"), render_timeout=TIMEOUT) as r:
        yield r


@functools.cache
def hf(family: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(family)))  # type: ignore[arg-type]


@functools.cache
def fast(family: str) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tokenizer_dir(family) / "tokenizer.json"))  # type: ignore[arg-type]


CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Why is the sky blue? "}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 数据 × 3 ?\n"},
        {"role": "assistant", "content": "The answer is "},
    ],
]


@pytest.mark.parametrize("family", ["qwen2", "llama"])
async def test_matches_transformers(family: str, qwen: Renderer, llama: Renderer) -> None:
    renderer = qwen if family == "qwen2" else llama
    for chat in CHATS:
        for add_generation_prompt in (True, False):
            want = hf(family).apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
            got = await renderer.render_chat(chat, add_generation_prompt=add_generation_prompt)
            assert got == want
        if chat[-1]["role"] == "assistant":
            want = hf(family).apply_chat_template(chat, tokenize=False, continue_final_message=True)
            got = await renderer.render_chat(chat, add_generation_prompt=False, continue_final_message=True)
            assert got == want and got.rstrip().endswith("The answer is")


async def test_request_templates_kwargs_tools_documents_match_transformers(qwen: Renderer) -> None:
    chat = CHATS[2][:3]
    template = (
        "{{ greeting }}|{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ documents | tojson(indent=1) }}"
        "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    documents = [{"title": "t", "text": "über"}]
    got = await qwen.render_chat(
        chat, chat_template=template, tools=tools, documents=documents, chat_template_kwargs={"greeting": "hi"}
    )
    want = hf("qwen2").apply_chat_template(
        chat,
        chat_template=template,
        tools=tools,
        documents=documents,
        tokenize=False,
        add_generation_prompt=True,
        greeting="hi",
    )
    assert got == want and got.startswith("hi||<|im_end|>|")
    assert (await qwen.render_chat(chat, chat_template="{{ greeting }}")) == "default"
    # Keys set to None are dropped and reasoning is aliased, as transformers does.
    chat = [
        {"role": "user", "content": "q", "name": None},
        {"role": "assistant", "content": "a", "reasoning": "think", "tool_calls": None},
    ]
    template = (
        "{% for m in messages %}{{ m.role }}|{{ m.reasoning_content }}|{{ m.thinking }}|"
        "{{ m.tool_calls is defined }}|{{ m.name is defined }};{% endfor %}"
    )
    want = hf("qwen2").apply_chat_template(chat, chat_template=template, tokenize=False)
    assert await qwen.render_chat(chat, chat_template=template, add_generation_prompt=False) == want
    assert "think|think|False" in want
    # Mistral's template, with bos/eos from the llama folder's tokenizer.
    want = hf("llama").apply_chat_template(CHATS[2], chat_template=MISTRAL_CHAT_TEMPLATE, tokenize=False)
    mistral = await qwen.render_chat(
        CHATS[2],
        chat_template=MISTRAL_CHAT_TEMPLATE.replace("bos_token", "'<s>'").replace("eos_token", "'</s>'"),
        add_generation_prompt=False,
    )
    assert mistral == want


async def test_text_parts_and_bad_parts(qwen: Renderer) -> None:
    joined = await qwen.render_chat([{"role": "user", "content": "a\nb"}])
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert await qwen.render_chat([{"role": "user", "content": parts}]) == joined
    with pytest.raises(RenderError, match="image_url"):
        await qwen.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(RenderError, match="at least one"):
        await qwen.render_chat([])


async def test_request_errors(qwen: Renderer, llama: Renderer) -> None:
    with pytest.raises(RenderError, match="trust-request-chat-template"):
        await llama.render_chat(CHATS[0], chat_template="{{ 1 }}")
    with pytest.raises(RenderError, match="cannot both"):
        await qwen.render_chat(CHATS[2], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(RenderError, match="roles must alternate"):  # the template's raise_exception
        await llama.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(RenderError, match="messages"):
        await qwen.render_chat(CHATS[0], chat_template_kwargs={"messages": []})
    with pytest.raises(RenderError, match="syntax error"):
        await qwen.render_chat(CHATS[0], chat_template="{% for %}")


ESCAPES = [
    "{{ messages.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__['os'] }}",
    "{{ raise_exception.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ '{0.__class__}'.format(messages) }}",
    "{{ '{0.__init__.__globals__}'.format(cycler) }}",
    "{{ '{a.__class__.__base__}'.format_map({'a': messages}) }}",
    "{{ self._TemplateReference__context }}",
    "{{ self._TemplateReference__context.parent }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ messages.append(1) }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ dict.__call__.__globals__ }}",
]


@pytest.mark.parametrize("template", ESCAPES)
async def test_sandbox_escapes_are_refused_without_leaks(qwen: Renderer, template: str) -> None:
    with pytest.raises(RenderError) as info:
        await qwen.render_chat(CHATS[0], chat_template=template)
    message = str(info.value)
    for leak in ("0x", "<function", "<module", "<class", "<built-in", "<bound", "Context {"):
        assert leak not in message, message


async def test_giant_values_fail_fast(qwen: Renderer) -> None:
    for template in [
        "{{ 'x' * 10**10 }}",
        "{{ 2 ** (10 ** 8) }}",
        # Not caught by the '*' check: the worker's memory cap stops it.
        "{{ range(100000) | join('y' * 2**24) }}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    ]:
        with anyio.fail_after(TIMEOUT):  # refused before the render time limit
            with pytest.raises(RenderError, match="limit|exponent"):
                await qwen.render_chat(CHATS[0], chat_template=template)
    assert await qwen.render_chat(CHATS[0]) == hf("qwen2").apply_chat_template(
        CHATS[0], tokenize=False, add_generation_prompt=True
    )


async def _all_workers_up(renderer: Renderer, n: int) -> None:
    """Until `n` workers are started, ready and free. Replacements for workers killed by earlier tests start
    in the background; the pool handing a ready worker to its idle queue wakes this (an event, no polling).
    (`worker_pids` would not do: a worker is listed from its spawn on, before it is ready.)"""
    pool = renderer._pool
    handed_over = anyio.Event()

    def release(worker: Any, _release: Any = pool._release) -> None:
        _release(worker)
        handed_over.set()

    pool._release = release  # type: ignore[method-assign]
    try:
        with anyio.fail_after(30):
            while pool._idle_recv.statistics().current_buffer_used < n:
                await handed_over.wait()
                handed_over = anyio.Event()
    finally:
        del pool._release


async def test_template_over_the_memory_cap_leaves_the_worker_usable(qwen: Renderer) -> None:
    # Tokenizing is capped too (test_worker_limits.py); this text needs well under the fixture's 256 MiB.
    text = "数据 hello world, " * 15_000
    for _ in range(2):  # one of the two workers may not have rendered yet: make both render, then encode
        with pytest.raises(RenderError, match="memory limit"):
            await qwen.render_chat(CHATS[0], chat_template="{{ range(100000) | join('y' * 2**24) }}")
    assert await qwen.encode(text) == fast("qwen2").encode(text).ids


async def test_runaway_template_is_killed_while_others_render(qwen: Renderer) -> None:
    await _all_workers_up(qwen, 2)
    pids_before = set(qwen.worker_pids)
    normal_done_at: list[float] = []
    errors: list[RenderError] = []
    start = anyio.current_time()

    async def runaway() -> None:
        try:
            await qwen.render_chat(CHATS[0], chat_template=RUNAWAY)
        except RenderError as e:
            errors.append(e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(runaway)
        await anyio.wait_all_tasks_blocked()  # the runaway holds one worker; the other serves this render
        await qwen.render_chat(CHATS[1])
        normal_done_at.append(anyio.current_time())
    elapsed = anyio.current_time() - start
    assert len(errors) == 1 and "longer than" in str(errors[0])
    assert TIMEOUT <= elapsed < TIMEOUT + 1.5
    assert normal_done_at[0] - start < TIMEOUT
    killed = pids_before - set(qwen.worker_pids)
    assert len(killed) == 1
    assert not os.path.exists(f"/proc/{killed.pop()}")  # killed and reaped: it burns no CPU
    # A fresh worker takes the slot.
    assert await qwen.render_chat(CHATS[0], add_generation_prompt=False) == hf("qwen2").apply_chat_template(
        CHATS[0], tokenize=False
    )
    await _all_workers_up(qwen, 2)


async def test_cancelled_requests_leave_workers_in_sync(qwen: Renderer) -> None:
    text = "hello world, " * 20000
    await _all_workers_up(qwen, 2)
    pids = set(qwen.worker_pids)
    for _ in range(2):  # both workers get a cancelled encode whose late reply must be drained
        with anyio.move_on_after(0.001):
            await qwen.encode(text)
    probe = "abc def " * 100  # long enough to go to a worker
    for _ in range(2):
        assert await qwen.encode(probe, add_special_tokens=False) == fast("qwen2").encode(probe).ids
    assert set(qwen.worker_pids) == pids  # drained, not killed
    with anyio.move_on_after(0.1) as scope:
        await qwen.render_chat(CHATS[0], chat_template=RUNAWAY)
    assert scope.cancelled_caught
    # The caller left but the render runs on: its worker is killed at the render's deadline, not reused.
    with anyio.fail_after(TIMEOUT + 10):
        while all(alive(p) for p in pids):
            await anyio.sleep(0.02)  # observing other processes: no event to wait on
    assert await qwen.decode([14990, 1879] * 300) == "hello world" * 300
    await _all_workers_up(qwen, 2)
    assert len(pids - set(qwen.worker_pids)) == 1  # that one worker only, replaced


@pytest.mark.parametrize("family", ["qwen2", "llama"])
async def test_encode_decode_match_tokenizer(family: str, qwen: Renderer, llama: Renderer) -> None:
    renderer = qwen if family == "qwen2" else llama
    ref = fast(family)
    texts = [
        "Hello world",
        " leading space",
        "数据科学 ü é\u0301",
        "<|im_start|>user\nhi<|im_end|>",
        "<s>[INST] x [/INST]",
        "",
        "long " * 30000,
    ]
    for text in texts:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special).ids
            assert await renderer.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert await renderer.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert renderer.tokenizer.encode("Hello").ids == ref.encode("Hello").ids
    for bad in ([-1], [-1] + [1] * 600):  # on the event loop and in a worker
        with pytest.raises(RenderError, match="cannot decode"):
            await renderer.decode(bad)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
async def test_encode_pair_matches_transformers(family: str, qwen: Renderer, llama: Renderer) -> None:
    """A cross-encoder's (query, document) as transformers' tokenizer(text, text_pair) joins it; on the event loop
    and, past 512 characters, in a worker."""
    renderer = qwen if family == "qwen2" else llama
    for query, doc in (("what is a cat", "a cat is an animal"), ("q", "long " * 300), ("数据", "")):
        for special in (True, False):
            expected = hf(family)(query, doc, add_special_tokens=special)["input_ids"]
            assert await renderer.encode_pair(query, doc, special) == expected


def _tiny_tokenizer_dir(path: Path) -> Path:
    """A word-level tokenizer folder without a chat template: loads in milliseconds."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return path


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time process `pid` has used (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_waiting_queue_is_bounded(tmp_path: Path, anyio_backend: str) -> None:
    from server.render.renderer import RendererOverloaded

    bare = _tiny_tokenizer_dir(tmp_path / "tiny")
    async with Renderer.open(
        bare,
        chat_template="{{ messages[0].content }}",
        render_timeout=1.0,
        trust_request_chat_template=True,
        max_waiting=1,
    ) as r:
        outcomes: list[str] = []

        async def render(template: str | None) -> None:
            try:
                outcomes.append(await r.render_chat(CHATS[0], chat_template=template))
            except RenderError as e:
                outcomes.append("timeout" if "longer than" in str(e) else str(e))

        async with anyio.create_task_group() as tg:
            tg.start_soon(render, RUNAWAY)  # holds the only worker for 1 s
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(render, None)  # waits: the one allowed waiter
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(RendererOverloaded, match="retry later"):
                await r.render_chat(CHATS[0])
        assert sorted(outcomes) == ["Hello there", "timeout"]
        await _all_workers_up(r, 1)
        # A worker that dies while idle is replaced without failing the next request.
        (pid,) = r.worker_pids
        os.kill(pid, signal.SIGKILL)
        await anyio.to_thread.run_sync(wait_gone, pid, 10)  # dead: gone, or a zombie until the pool reaps it
        assert await r.render_chat([{"role": "user", "content": "hello world"}]) == "hello world"
        assert r.worker_pids != [pid]
        with pytest.raises(RenderError, match="cannot take"):  # a lone surrogate cannot cross the pipe
            await r.render_chat([{"role": "user", "content": "\ud800" + "x" * 600}])
        assert await r.encode("hello world " * 100) == [1, 2] * 100


_ORPHAN_SCRIPT = """
import sys, anyio
from server.render.renderer import Renderer

async def main():
    async with Renderer.open(sys.argv[1], chat_template="{{ 1 }}", trust_request_chat_template=True,
                             num_workers=2, render_timeout=60) as r:
        print(*r.worker_pids, flush=True)
        await r.render_chat([{"role": "user", "content": "x"}], chat_template=sys.argv[2])

anyio.run(main, backend=sys.argv[3])
"""


def test_workers_exit_when_the_server_is_killed(tmp_path: Path, anyio_backend: str) -> None:
    import subprocess
    import sys
    import time

    tiny = _tiny_tokenizer_dir(tmp_path / "tiny")
    proc = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT, str(tiny), RUNAWAY, anyio_backend], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        # Ready workers sit idle; one is deep in the runaway render once it has burnt CPU since (observed in
        # /proc, the other processes' state: no event reaches this one).
        idle = {p: _cpu_seconds(p) for p in pids}
        deadline = time.monotonic() + 30
        while max(_cpu_seconds(p) - idle[p] for p in pids) < 0.2:
            assert time.monotonic() < deadline, "no worker started the runaway render"
            time.sleep(0.02)
    finally:
        proc.kill()  # no cleanup runs: the workers must notice on their own
        proc.wait()
    wait_gone(pids, 10)


class _Chunks:
    """A worker's stdout that hands out the given chunks, then EOF."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.asked: list[int] = []

    async def receive(self, max_bytes: int = 65536) -> bytes:
        self.asked.append(max_bytes)
        if not self.chunks:
            raise anyio.EndOfStream
        return self.chunks.pop(0)


def _fake_worker(stdout: _Chunks) -> Any:
    from types import SimpleNamespace

    from server.render.worker_pool import _Worker

    return _Worker(SimpleNamespace(stdin=object(), stdout=stdout))  # type: ignore[arg-type]


async def test_pool_reads_the_engine_frame_format(anyio_backend: str) -> None:
    from engine.transport.ipc import FrameEncoder
    from server.render.worker_pool import _BROKEN, _MAX_REPLY_BYTES

    enc = FrameEncoder()
    big = enc.encode([0, "y" * 300_000])
    two = enc.encode([0, "a"]) + enc.encode([1, "b"])
    stdout = _Chunks(*[bytes([b]) for b in enc.encode([0, 7])], big[:10], big[10:], two)
    worker = _fake_worker(stdout)
    assert await worker.receive() == (0, 7)  # split to single bytes
    assert await worker.receive() == (0, "y" * 300_000)
    assert stdout.asked[-1] >= len(big) - 10  # the rest of a large reply in one read
    assert await worker.receive() == (0, "a") and await worker.receive() == (1, "b")  # two in one read
    with pytest.raises(_BROKEN):
        await worker.receive()  # EOF
    for bad in ((_MAX_REPLY_BYTES + 1).to_bytes(4, "big"), enc.encode([0]), enc.encode("not a reply"), b"\0\0\0\1\xc1"):
        with pytest.raises(_BROKEN):  # a broken or subverted worker is replaced, never trusted
            await _fake_worker(_Chunks(bad)).receive()


def test_worker_imports_stay_light() -> None:
    # it starts per slot and after every kill: engine.transport.ipc (frames, die_with_parent) must not pull in torch
    import subprocess
    import sys

    code = "import sys, server.render.render_worker; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


async def test_template_sources(tmp_path: Path, anyio_backend: str) -> None:
    bare = _tiny_tokenizer_dir(tmp_path / "bare")
    template_file = tmp_path / "t.jinja"
    template_file.write_text("{% for m in messages %}{{ m.content }};{% endfor %}")
    assert load_chat_template(str(template_file), bare) == template_file.read_text()
    assert load_chat_template("{{ 1 }}", bare) == "{{ 1 }}"
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template("templates/missing.jinja", bare)
    assert load_chat_template(None, bare) is None
    llama_dir = tokenizer_dir("llama")
    assert load_chat_template(None, llama_dir) == (llama_dir / "chat_template.jinja").read_text()
    (bare / "tokenizer_config.json").write_text(
        '{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}'
    )
    assert load_chat_template(None, bare) == "D"
    (bare / "tokenizer_config.json").unlink()
    async with Renderer.open(bare) as r:
        assert not r.has_chat_template
        with pytest.raises(RenderError, match="--chat-template"):
            await r.render_chat(CHATS[0])
    async with Renderer.open(bare, chat_template=str(template_file)) as r:
        assert r.has_chat_template and await r.render_chat(CHATS[1]) == "Be brief.; Why is the sky blue? ;"
    with pytest.raises(ValueError, match="does not compile"):
        async with Renderer.open(bare, chat_template="{% if %}"):
            pass
