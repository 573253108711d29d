"""AsyncLLM against the FakeEngineClient: ordering, abort-exactly-once, engine death, n > 1, admission,
heartbeats. On Trio and asyncio (the CLI serves on either)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from fake_engine import FakeEngineClient
from prometheus_client.parser import text_string_to_metric_families

from demo.tokenizers import load_tokenizer
from engine.messages import AddRequest, EngineStats, SamplingParams
from server.http.errors import APIError
from server.metrics.prometheus import ServerMetrics
from server.request.admission import Admission
from server.request.async_llm import AsyncLLM, detokenizer_factory
from server.request.collector import OutputKind
from server.request.input_processor import GenerationSpec

pytestmark = pytest.mark.anyio
TOK = load_tokenizer("qwen2")
TEXT = "The quick brown fox jumps over the lazy dog, and then it sleeps."
GEN = TOK.encode(TEXT).ids
PROMPT = TOK.encode("Tell me a story:").ids


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def spec(
    rid: str,
    *,
    n: int = 1,
    stop: tuple[str, ...] = (),
    kind: OutputKind = OutputKind.DELTA,
    seed: int | None = None,
    max_tokens: int = 100,
) -> GenerationSpec:
    return GenerationSpec(
        external_id=rid,
        request_id=rid,
        prompt_token_ids=PROMPT,
        params=SamplingParams(max_tokens=max_tokens, seed=seed),
        n=n,
        stop=stop,
        output_kind=kind,
    )


@asynccontextmanager
async def running(fake: FakeEngineClient, **kw: Any) -> AsyncIterator[AsyncLLM]:
    llm = AsyncLLM(fake, detokenizer_factory(TOK), **kw)
    async with anyio.create_task_group() as tg:
        await tg.start(llm.run)
        yield llm
        tg.cancel_scope.cancel()


async def collect(llm: AsyncLLM, specs: list[GenerationSpec]) -> dict[int, list[Any]]:
    got: dict[int, list[Any]] = {}
    async with llm.generate(specs) as outputs:
        async for batch in outputs:
            for out in batch:
                got.setdefault(out.index, []).append(out)
    return got


async def test_stream_matches_reference_and_engine_not_aborted() -> None:
    fake = FakeEngineClient(lambda req: GEN)
    async with running(fake) as llm:
        got = await collect(llm, [spec("a")])
    assert "".join(o.text for o in got[0]) == TEXT
    assert got[0][-1].finish_reason == "length"
    assert fake.aborted == []  # the engine finished it itself: nothing to abort


async def test_cancel_aborts_exactly_once() -> None:
    fake = FakeEngineClient(lambda req: GEN * 50, gate=True)
    async with running(fake) as llm:
        with anyio.move_on_after(5) as scope:
            async with llm.generate([spec("c")]) as outputs:
                fake.allow_step(3)
                async for batch in outputs:
                    if sum(o.num_output_tokens for o in batch) >= 3:
                        scope.cancel()  # the client went away
        assert scope.cancelled_caught
        assert fake.aborted == ["c"]
        assert llm.output.states == {}


async def test_stop_string_aborts_once_and_stops_the_stream() -> None:
    fake = FakeEngineClient(lambda req: GEN * 50)
    async with running(fake) as llm:
        got = await collect(llm, [spec("s", stop=("lazy",))])
        await anyio.wait_all_tasks_blocked()
    assert "".join(o.text for o in got[0]) == TEXT[: TEXT.index("lazy")]
    assert (got[0][-1].finish_reason, got[0][-1].stop_reason) == ("stop", "lazy")
    assert fake.aborted == ["s"]


async def test_engine_death_fails_in_flight_and_refuses_new() -> None:
    fake = FakeEngineClient(lambda req: GEN * 50, gate=True)
    deaths: list[str] = []
    async with running(fake, on_dead=deaths.append) as llm:
        async with llm.generate([spec("d1")]) as outputs:
            fake.allow_step(1)
            first = await outputs.__anext__()
            assert first[0].error is None
            fake.die("pipe closed")
            with anyio.fail_after(5):
                batch = await outputs.__anext__()
            assert batch[0].finish_reason == "error" and "pipe closed" in (batch[0].error or "")
        with pytest.raises(APIError) as e:
            async with llm.generate([spec("d2")]):
                pass
        assert e.value.status == 503
    assert len(deaths) == 1 and llm.dead is not None


async def test_n_children_with_derived_seeds_and_one_parent() -> None:
    fake = FakeEngineClient(lambda req: GEN[: 5 + int(req.request_id[-1])])
    async with running(fake) as llm:
        got = await collect(llm, [spec("p", n=3, seed=7, kind=OutputKind.FINAL_ONLY)])
    assert [r.request_id for r in fake.added] == ["p-0", "p-1", "p-2"]
    assert [r.params.seed for r in fake.added] == [7, 8, 9]
    for i in range(3):
        (final,) = got[i]
        assert final.token_ids == GEN[: 5 + i] and final.text == TOK.decode(GEN[: 5 + i])


async def test_admission_refuses_then_accounts_back_to_zero() -> None:
    fake = FakeEngineClient(lambda req: GEN, gate=True)
    admission = Admission(max_num_queued_reqs=2, max_num_queued_tokens=None)
    async with running(fake, admission=admission) as llm:
        async with llm.generate([spec("q1", n=2)]) as outputs:
            assert admission.queued_reqs == 2
            with pytest.raises(APIError) as e:  # the queue is full until a first token
                async with llm.generate([spec("q2")]):
                    pass
            assert e.value.status == 503 and e.value.retry_after is not None
            fake.allow_step(1)
            await outputs.__anext__()
            await anyio.wait_all_tasks_blocked()
            assert admission.queued_reqs == 0
        assert admission.queued_reqs == 0 and admission.queued_tokens == 0
        async with llm.generate([spec("q3")]):  # left before any token: released on exit
            assert admission.queued_reqs == 1
        assert admission.queued_reqs == 0 and admission.queued_tokens == 0


async def test_route_ticket_settled_by_generate_and_released_once_when_cancelled() -> None:
    """The route's ticket (a lower bound, before rendering) becomes the exact count in generate, without a second
    reservation; a cancelled consumer gives back what it still holds, once, and a refused settle keeps the bound."""
    fake = FakeEngineClient(lambda req: GEN, gate=True)
    admission = Admission(max_num_queued_reqs=3, max_num_queued_tokens=3 * len(PROMPT))
    async with running(fake, admission=admission) as llm:
        with llm.admit(2, 2) as ticket:
            assert (admission.queued_reqs, admission.queued_tokens) == (2, 2)
            with anyio.CancelScope() as scope:
                async with llm.generate([spec("t", n=2)], ticket) as outputs:
                    assert (admission.queued_reqs, admission.queued_tokens) == (2, 2 * len(PROMPT))
                    fake.allow_step(1)
                    await outputs.__anext__()  # one step: both children got their first token
                    assert (admission.queued_reqs, admission.queued_tokens) == (0, 0)
                    scope.cancel()
                    await anyio.sleep_forever()
            assert scope.cancelled_caught and ticket.held == (0, 0)
        with llm.admit(1, 1) as ticket:
            with anyio.CancelScope() as scope:
                async with llm.generate([spec("c")], ticket):
                    assert ticket.held == (1, len(PROMPT)) == (admission.queued_reqs, admission.queued_tokens)
                    scope.cancel()  # before any token: generate's clean-up gives it all back
                    await anyio.sleep_forever()
            assert scope.cancelled_caught and (admission.queued_reqs, admission.queued_tokens) == (0, 0)
        assert (admission.queued_reqs, admission.queued_tokens) == (0, 0)  # the `with` released nothing twice
        with pytest.raises(APIError) as e:
            llm.admit(4, 4)  # more choices than queue slots: refused before any rendering
        assert e.value.status == 503 and "needs 4 queue slots" in e.value.message
        with llm.admit(1, 1) as small:
            with pytest.raises(APIError) as e:  # the exact prompt does not fit beside the other request
                other = llm.admit(2, 2 * len(PROMPT) + 1)
                async with llm.generate([spec("big", n=1)], small):
                    pass
            assert "too many queued prompt tokens" in e.value.message and small.held == (1, 1)
            other.release()
        assert (admission.queued_reqs, admission.queued_tokens) == (0, 0)


async def test_registered_before_sent() -> None:
    """A fast engine answering inside add_request must find the request registered."""

    class Eager(FakeEngineClient):
        def add_request(self, req: AddRequest) -> None:
            assert req.request_id in llm.output.states
            super().add_request(req)

    fake = Eager(lambda req: GEN[:3])
    async with running(fake) as llm:
        got = await collect(llm, [spec("e")])
    assert "".join(o.text for o in got[0]) == TOK.decode(GEN[:3])


def samples(metrics: ServerMetrics) -> dict[str, float]:
    """name -> value of every sample in the /metrics text (one model, so names are unique enough here)."""
    return {
        s.name: s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if "finished_reason" not in s.labels and "reason" not in s.labels
    }


async def test_heartbeats_update_stats_and_leave_outputs_alone() -> None:
    fake = FakeEngineClient(lambda req: GEN * 50, gate=True, heartbeats=True)
    metrics = ServerMetrics("tiny")
    async with running(fake, metrics=metrics) as llm:
        # Idle: only heartbeats arrive, and they carry the engine's stats into the metrics.
        fake.stats = EngineStats(
            num_running=3,
            num_waiting=2,
            num_used_blocks=25,
            num_total_blocks=100,
            num_preemptions=4,
            prefix_cache_queries=50,
            prefix_cache_hits=20,
        )
        await fake.wait_heartbeats(fake.heartbeats_sent + 1)
        assert fake.steps == 0
        got = samples(metrics)
        assert (got["spindle_num_requests_running"], got["spindle_num_requests_waiting"]) == (3, 2)
        assert got["spindle_kv_cache_usage_perc"] == 0.25
        assert (
            got["spindle_num_preemptions_total"],
            got["spindle_prefix_cache_queries_total"],
            got["spindle_prefix_cache_hits_total"],
        ) == (4, 50, 20)
        # The same cumulative counts again count nothing again; newer ones add only the difference.
        await fake.wait_heartbeats(fake.heartbeats_sent + 2)
        assert samples(metrics)["spindle_num_preemptions_total"] == 4
        fake.stats = EngineStats(1, 0, 10, 100, 5, 80, 30)
        await fake.wait_heartbeats(fake.heartbeats_sent + 1)
        got = samples(metrics)
        assert (got["spindle_num_requests_running"], got["spindle_num_requests_waiting"]) == (1, 0)
        assert (
            got["spindle_num_preemptions_total"],
            got["spindle_prefix_cache_queries_total"],
            got["spindle_prefix_cache_hits_total"],
        ) == (5, 80, 30)

        # A running request that the engine does not step: heartbeats reach no consumer.
        async with llm.generate([spec("g")]) as outputs:
            await fake.wait_heartbeats(fake.heartbeats_sent + 3)
            assert outputs.poll() is None and llm.dead is None

        # A stream with a heartbeat after every step: the same outputs as without heartbeats.
        fake.gate = False
        beats, steps = fake.heartbeats_sent, fake.steps
        got_outputs = await collect(llm, [spec("h", max_tokens=len(GEN))])
        assert fake.steps - steps == len(GEN)  # one token per step
        assert fake.heartbeats_sent - beats >= len(GEN) - 1  # one after every step (the last one's may be later)
        assert llm.dead is None
    assert "".join(o.text for o in got_outputs[0]) == TEXT
    assert [t for o in got_outputs[0] for t in o.token_ids] == GEN
    assert [o.finish_reason for o in got_outputs[0]] == [None] * (len(got_outputs[0]) - 1) + ["length"]
    assert fake.aborted == ["g"]


async def test_images_cross_the_pipe_once_and_an_engine_miss_is_resent() -> None:
    from engine.messages import IMAGE_CACHE_MISS, ImageInput
    from server.multimodal.mirror import EngineImageMirror

    engine_has: set[str] = set()  # what the fake engine's encoder cache holds

    def refuse(req: AddRequest) -> str | None:
        missing = [i.hash for i in req.mm_inputs or () if i.data is None and i.hash not in engine_has]
        return f"{IMAGE_CACHE_MISS} image {missing[0]} is not cached" if missing else None

    def with_image(rid: str) -> GenerationSpec:
        s = spec(rid, max_tokens=3)
        s.mm_inputs = [ImageInput("h1", 0, 2, [1, 2, 4], b"\0" * 16, [2, 2])]
        return s

    fake = FakeEngineClient(lambda req: GEN, refuse=refuse)
    metrics = ServerMetrics("tiny")
    async with running(fake, metrics=metrics) as llm:
        llm.images = EngineImageMirror(1 << 20, 64, "float32")
        await collect(llm, [with_image("a")])
        engine_has.add("h1")  # the engine encoded it
        await collect(llm, [with_image("b")])
        engine_has.clear()  # ...and evicted it: the mirror has drifted
        got = await collect(llm, [with_image("c")])
    assert [
        (r.request_id, r.mm_inputs[0].data is not None)
        for r in fake.added  # type: ignore[index]
    ] == [("a", True), ("b", False), ("c", False), ("c", True)]  # pixels crossed once, and on the miss
    assert got[0][-1].error is None and "".join(o.text for o in got[0]) == TOK.decode(GEN[:3])
    counts = samples(metrics)
    assert (counts["spindle_mm_engine_cache_hits_total"], counts["spindle_mm_engine_cache_misses_total"]) == (2, 1)
