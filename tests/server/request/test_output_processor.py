"""The output processor with the real Qwen2 tokenizer and the real incremental detokenizer, on Trio and asyncio."""

from __future__ import annotations

import random

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from demo.tokenizers import load_tokenizer
from engine.messages import EngineStats, RequestOutput, StepOutputs
from server.request.collector import Collector, Output, OutputKind
from server.request.detokenizer import IncrementalDetokenizer
from server.request.output_processor import OutputProcessor, RequestState

pytestmark = pytest.mark.anyio
STATS = EngineStats(0, 0, 0, 1, 0, 0, 0)
TEXT = "Grüße, 世界! The quick brown fox jumps over the lazy dog. 🦊🐶 done"


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return load_tokenizer("qwen2")


def reference(tok, prompt: list[int], gen: list[int]) -> str:  # type: ignore[no-untyped-def]
    return tok.decode(prompt + gen)[len(tok.decode(prompt)) :]


def make(
    tok,
    kind: OutputKind,
    *,
    stop: tuple[str, ...] = (),
    interval: int = 1,  # type: ignore[no-untyped-def]
    prompt: list[int] | None = None,
) -> tuple[OutputProcessor, RequestState, Collector]:
    prompt = prompt if prompt is not None else tok.encode("Say:").ids
    proc = OutputProcessor(stream_interval=interval)
    collector = Collector(kind)
    detok = IncrementalDetokenizer(tok, prompt, stop=stop)
    state = RequestState("r", 0, collector, detok, kind, bool(stop), len(prompt))
    proc.add(state)
    return proc, state, collector


def step(*outs: RequestOutput) -> StepOutputs:
    return StepOutputs(list(outs), 0.0, STATS)


def drain(collector: Collector) -> list[list[Output]]:
    got = []
    while (batch := collector.poll()) is not None:
        got.append(batch)
    return got


async def test_delta_stream_concatenates_to_reference(tok) -> None:  # type: ignore[no-untyped-def]
    proc, _, collector = make(tok, OutputKind.DELTA)
    gen = tok.encode(TEXT).ids
    texts, ids = [], []
    for i, tid in enumerate(gen):
        last = i == len(gen) - 1
        await proc.process_outputs(step(RequestOutput("r", [tid], "length" if last else None)))
        for batch in drain(collector):  # the consumer keeps up: one output per hand-over
            texts += [o.text for o in batch]
            ids += [t for o in batch for t in o.token_ids]
    assert "".join(texts) == reference(tok, tok.encode("Say:").ids, gen) == TEXT
    assert ids == gen
    assert "r" not in proc.states


async def test_slow_consumer_gets_one_merged_output(tok) -> None:  # type: ignore[no-untyped-def]
    proc, _, collector = make(tok, OutputKind.DELTA)
    gen = tok.encode(TEXT).ids
    for i, tid in enumerate(gen):
        await proc.process_outputs(step(RequestOutput("r", [tid], "length" if i == len(gen) - 1 else None)))
    batches = drain(collector)  # nobody read until now: everything waits in the one slot
    assert len(batches) == 1 and len(batches[0]) == 1
    out = batches[0][0]
    assert out.text == TEXT and out.token_ids == gen
    assert out.finish_reason == "length" and out.num_output_tokens == len(gen)


class Taking:
    """A consumer's own waiter whose wake-up takes unfinished outputs at once while `accept` (as the direct
    write path's does, in the producer's task); otherwise it counts a wake-up of the consumer."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.accept = True
        self.taken: list[Output] = []
        self.woken = 0

    async def wait(self) -> None:
        raise AssertionError("nobody waits in these tests")

    def wake(self) -> None:
        got = self.collector.peek()
        assert got is not None and len(got) == 1  # woken as the empty slot fills
        if self.accept and got[0].finish_reason is None:
            self.taken += self.collector.poll() or []
        else:
            self.woken += 1


async def test_an_own_waiter_may_take_outputs_as_the_empty_slot_fills(tok) -> None:  # type: ignore[no-untyped-def]
    proc, _, collector = make(tok, OutputKind.DELTA)
    gen = tok.encode(TEXT).ids
    waiter = Taking(collector)
    collector.use_waiter(waiter)
    await proc.process_outputs(step(RequestOutput("r", gen[:3], None)))
    await proc.process_outputs(step(RequestOutput("r", gen[3:6], None)))
    assert collector.poll() is None and len(waiter.taken) == 2 and waiter.woken == 0  # taken, nothing queued
    waiter.accept = False
    await proc.process_outputs(step(RequestOutput("r", gen[6:9], None)))  # declined: queued, consumer woken
    waiter.accept = True
    await proc.process_outputs(step(RequestOutput("r", gen[9:12], None)))  # slot taken: merged, no wake-up
    await proc.process_outputs(step(RequestOutput("r", gen[12:], "length")))
    assert len(waiter.taken) == 2 and waiter.woken == 1
    queued = drain(collector)
    assert len(queued) == 1 and len(queued[0]) == 1 and queued[0][0].finish_reason == "length"
    assert "".join(o.text for o in waiter.taken) + queued[0][0].text == TEXT
    assert [t for o in waiter.taken for t in o.token_ids] + queued[0][0].token_ids == gen


async def test_slow_reader_merge_keeps_every_token_and_owns_its_lists(tok) -> None:  # type: ignore[no-untyped-def]
    """A consumer that never takes the slot gets one merged output equal to the whole stream (text, ids,
    logprobs), and merging grows the waiting output's own lists in place instead of copying them."""
    from engine.messages import TokenLogprobs

    proc, _, collector = make(tok, OutputKind.DELTA)
    gen = tok.encode(TEXT * 20).ids
    lps = [TokenLogprobs(t, -1.0, 1, [], []) for t in gen]
    first_ids = None
    for i, tid in enumerate(gen):
        await proc.process_outputs(
            step(RequestOutput("r", [tid], "length" if i == len(gen) - 1 else None, logprobs=[lps[i]]))
        )
        if first_ids is None and collector._batch is not None:
            first_ids = collector._batch[0].token_ids
    (batch,) = drain(collector)
    (out,) = batch
    assert out.text == reference(tok, tok.encode("Say:").ids, gen)
    assert out.token_ids == gen and [lp.token_id for lp in out.logprobs or []] == gen
    assert out.token_ids is first_ids  # the first output's list, extended: no copy per merge
    assert out.finish_reason == "length"


async def test_final_only_logprobs_accumulate_in_one_list(tok) -> None:  # type: ignore[no-untyped-def]
    from engine.messages import TokenLogprobs

    proc, state, collector = make(tok, OutputKind.FINAL_ONLY)
    gen = tok.encode("one two three four five").ids
    lists = []
    for i, tid in enumerate(gen):
        last = i == len(gen) - 1
        await proc.process_outputs(
            step(RequestOutput("r", [tid], "length" if last else None, logprobs=[TokenLogprobs(tid, -0.5, 1, [], [])]))
        )
        if not last:
            lists.append(state.logprobs)
    assert all(lst is lists[0] for lst in lists)  # extended in place, never rebuilt per token
    (batch,) = drain(collector)
    assert [lp.token_id for lp in batch[0].logprobs or []] == gen and batch[0].text == "one two three four five"


async def test_final_only_builds_one_output(tok) -> None:  # type: ignore[no-untyped-def]
    proc, _, collector = make(tok, OutputKind.FINAL_ONLY)
    gen = tok.encode(TEXT).ids
    for tid in gen[:-1]:
        await proc.process_outputs(step(RequestOutput("r", [tid])))
        assert drain(collector) == []
    await proc.process_outputs(step(RequestOutput("r", gen[-1:], "stop")))
    (batch,) = drain(collector)
    assert batch[0].text == TEXT and batch[0].token_ids == gen and batch[0].finish_reason == "stop"


@pytest.mark.parametrize("interval", [1, 2, 5])
async def test_stream_interval(tok, interval: int) -> None:  # type: ignore[no-untyped-def]
    proc, _, collector = make(tok, OutputKind.DELTA, interval=interval)
    gen = tok.encode(" a b c d e f g h i j k").ids  # one token per word: no held-back text
    assert len(gen) == 11
    emitted_at = []
    for i, tid in enumerate(gen):
        await proc.process_outputs(step(RequestOutput("r", [tid], "length" if i == len(gen) - 1 else None)))
        if drain(collector):
            emitted_at.append(i + 1)
    # the first token at once, then every `interval` tokens, and at the end
    expected = sorted({1, *range(1 + interval, len(gen) + 1, interval), len(gen)})
    assert emitted_at == expected


async def test_stop_string_ends_and_asks_for_abort(tok) -> None:  # type: ignore[no-untyped-def]
    proc, state, collector = make(tok, OutputKind.DELTA, stop=("lazy",))
    gen = tok.encode(TEXT).ids
    aborts, texts, finish = [], [], None
    for tid in gen:
        aborts += await proc.process_outputs(step(RequestOutput("r", [tid])))
        for batch in drain(collector):
            texts += [o.text for o in batch]
            finish = (batch[-1].finish_reason, batch[-1].stop_reason)
        if state.finished:
            break
    assert "".join(texts) == TEXT[: TEXT.index("lazy")]
    assert finish == ("stop", "lazy")
    assert aborts == ["r"]  # the engine did not finish it: it must be aborted, once
    assert await proc.process_outputs(step(RequestOutput("r", [gen[-1]]))) == []  # later news is ignored


async def test_engine_error_and_stop_token(tok) -> None:  # type: ignore[no-untyped-def]
    proc, _, collector = make(tok, OutputKind.DELTA)
    await proc.process_outputs(step(RequestOutput("r", [], "error", error="prompt too long for the KV cache")))
    (batch,) = drain(collector)
    assert batch[0].finish_reason == "error" and batch[0].error == "prompt too long for the KV cache"

    proc, _, collector = make(tok, OutputKind.FINAL_ONLY)
    ids = tok.encode("hi").ids
    await proc.process_outputs(step(RequestOutput("r", ids + [151643], "stop", stop_token_id=151643)))
    (batch,) = drain(collector)
    assert batch[0].text == "hi" and batch[0].stop_reason == 151643


async def test_big_step_is_chunked_and_all_requests_served(tok) -> None:  # type: ignore[no-untyped-def]
    proc = OutputProcessor(chunk_size=3)
    collectors = []
    prompt = tok.encode("x").ids
    for i in range(10):
        c = Collector(OutputKind.DELTA)
        collectors.append(c)
        proc.add(RequestState(f"r{i}", 0, c, IncrementalDetokenizer(tok, prompt), OutputKind.DELTA, False, 1))
    ids = tok.encode(" hello").ids
    await proc.process_outputs(step(*(RequestOutput(f"r{i}", ids, "length") for i in range(10))))
    assert all(drain(c)[0][0].text == " hello" for c in collectors)
    assert proc.states == {}


async def test_own_waiters_are_woken_in_the_handlers_task_before_other_tasks_run(tok) -> None:  # type: ignore[no-untyped-def]
    """A consumer's waiter runs inside process_outputs: what it takes is taken before any route runs."""
    events: list[str] = []
    proc = OutputProcessor(chunk_size=3)
    prompt = tok.encode("x").ids

    class Logged(Taking):
        def wake(self) -> None:
            events.append(f"take {self.collector.poll()[0].text}")  # type: ignore[index]

    for i in range(7):
        c = Collector(OutputKind.DELTA)
        c.use_waiter(Logged(c))
        proc.add(RequestState(f"r{i}", 0, c, IncrementalDetokenizer(tok, prompt), OutputKind.DELTA, False, 1))

    async def other_task() -> None:  # runs only when the handler checkpoints between chunks
        events.append("other")

    ids = tok.encode(" hello").ids
    async with anyio.create_task_group() as tg:
        tg.start_soon(other_task)
        await proc.process_outputs(step(*(RequestOutput(f"r{i}", ids) for i in range(7))))
    assert [e for e in events if e != "other"] == ["take  hello"] * 7
    assert events.index("other") in (3, 6)  # between chunks, never inside one


SAMPLES = [
    "Grüße, 世界! The quick brown fox jumps over the lazy dog. 🦊🐶 done",
    "a\n\nb  c\t🦊🦊 ü ü <|im_end|> tail",
    "数字 1234567 and émoji 👩‍👩‍👧 end.",
]


@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from(SAMPLES), seed=st.integers(0, 10**6), interval=st.integers(1, 4), use_stop=st.booleans())
def test_delta_with_any_pacing_equals_final_only(
    tok,
    text: str,
    seed: int,
    interval: int,  # type: ignore[no-untyped-def]
    use_stop: bool,
) -> None:
    """Whatever the step sizes, the reader's pace and --stream-interval: DELTA pieces add up to FINAL_ONLY's text."""
    rng = random.Random(seed)
    gen = tok.encode(text).ids
    stop = (text[rng.randrange(5, len(text) - 3) :][: rng.randrange(1, 4)],) if use_stop else ()
    results = []
    for kind in (OutputKind.DELTA, OutputKind.FINAL_ONLY):
        step_rng = random.Random(seed)  # the same step sizes for both kinds
        proc, state, collector = make(tok, kind, stop=stop, interval=interval)
        pieces, ids, finish = [], [], None
        pos = 0
        while not state.finished and pos < len(gen):
            n = step_rng.randint(1, 3)
            new, pos = gen[pos : pos + n], pos + n
            anyio.run(proc.process_outputs, step(RequestOutput("r", new, "length" if pos >= len(gen) else None)))
            if step_rng.random() < 0.5 or state.finished:  # a reader that sometimes falls behind
                for batch in drain(collector):
                    pieces += [o.text for o in batch]
                    ids += [t for o in batch for t in o.token_ids]
                    finish = batch[-1].finish_reason
        results.append(("".join(pieces), ids, finish))
    assert results[0] == results[1]
    full = reference(tok, tok.encode("Say:").ids, gen)
    if not stop or stop[0] not in full:
        assert results[0][0] == full and results[0][2] == "length"
    else:
        assert results[0][0] == full[: full.index(stop[0])] and results[0][2] == "stop"


async def test_a_fault_in_one_request_fails_that_request_only(tok) -> None:  # type: ignore[no-untyped-def]
    """An exception while processing one request's output (here its detokenizer) ends that request with an
    error output and asks for its abort; the other request in the same step is served as usual."""

    class Broken(IncrementalDetokenizer):
        def next_delta(self, ids):  # type: ignore[no-untyped-def]
            raise RuntimeError("injected fault")

    prompt = tok.encode("Say:").ids
    proc = OutputProcessor()
    good, bad = Collector(OutputKind.DELTA), Collector(OutputKind.DELTA)
    proc.add(RequestState("good", 0, good, IncrementalDetokenizer(tok, prompt), OutputKind.DELTA, False, len(prompt)))
    proc.add(RequestState("bad", 0, bad, Broken(tok, prompt), OutputKind.DELTA, False, len(prompt)))
    gen = tok.encode(" hello there").ids
    to_abort = await proc.process_outputs(step(RequestOutput("bad", gen[:1]), RequestOutput("good", gen[:1])))
    assert to_abort == ["bad"]
    ((failed,),) = drain(bad)
    assert failed.finish_reason == "error" and "internal error" in (failed.error or "")
    assert "bad" not in proc.states  # finished: later outputs for it are ignored
    await proc.process_outputs(step(RequestOutput("bad", gen[1:2]), RequestOutput("good", gen[1:], "length")))
    assert drain(bad) == []
    texts = [o.text for batch in drain(good) for o in batch]
    assert "".join(texts) == reference(tok, prompt, gen)


async def test_a_failing_own_waiter_fails_that_request_only(tok) -> None:  # type: ignore[no-untyped-def]
    prompt = tok.encode("Say:").ids
    proc = OutputProcessor()
    c = Collector(OutputKind.DELTA)

    class Raising(Taking):
        def wake(self) -> None:
            raise AttributeError("a transport without the expected attribute")

    c.use_waiter(Raising(c))
    proc.add(RequestState("r", 0, c, IncrementalDetokenizer(tok, prompt), OutputKind.DELTA, False, len(prompt)))
    assert await proc.process_outputs(step(RequestOutput("r", tok.encode(" hi").ids))) == ["r"]
    ((out,),) = drain(c)
    assert out.finish_reason == "error"
