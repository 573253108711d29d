"""server/shared_state.py: admission limits and metrics shared by API-server processes through one memfd."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import pytest

from server.metrics.prometheus import ServerMetrics
from server.shared_state import SharedAdmission, SharedRegion, engine_routed, share_metrics


def _views(n: int) -> tuple[int, list[SharedRegion]]:
    fd, first = SharedRegion.create(n)
    return fd, [first, *(SharedRegion(fd, n, i) for i in range(1, n))]


def test_limits_hold_for_all_processes_together() -> None:
    fd, (r0, r1) = _views(2)
    a0, a1 = SharedAdmission(r0, 3, 100), SharedAdmission(r1, 3, 100)
    assert a0.try_admit(2, 10) is None
    assert a1.try_admit(1, 10) is None
    assert "too many queued requests (3 queued, limit 3)" in (a1.try_admit(1, 1) or "")
    assert a0.queued_reqs == a1.queued_reqs == 3 and a0.queued_tokens == 20
    assert a1.try_admit(1, 0, bound="at least ") is not None
    assert a1.try_admit(1, 5, held=(1, 5)) is None  # a ticket's own hold does not count against itself
    assert a1.own == (1, 10) and a0.queued_tokens == 20
    a0.first_token(10)  # one of a0's requests got its first token: (1, 0) left there
    assert a1.try_admit(1, 90) is None  # 3 requests, 100 tokens: both limits exactly reached
    assert "too many queued prompt tokens (100 queued + 1 requested" in (a0.try_admit(0, 1) or "")
    assert a0.own == (1, 0) and a1.own == (2, 100)
    with pytest.raises(RuntimeError, match="released twice"):
        a0.release(2, 0)  # a process releases only what it admitted itself
    a0.release(1, 0)
    a1.release(2, 100)
    assert a0.queued_reqs == 0 and a0.queued_tokens == 0
    os.close(fd)


def _hammer(fd: int, index: int, rounds: int, limit: int, held_by: Any, violations: Any) -> None:
    """Admit and release as fast as possible. `held_by[p]`: what process p holds (raised after its admit,
    lowered before its release, so it never overstates); their sum must never pass the limit. (The
    admission's own total may, for an instant: it includes reservations about to be taken back.)"""
    admission = SharedAdmission(SharedRegion(fd, 2, index), limit, None)
    held = 0
    for i in range(rounds):
        if admission.try_admit(1, 1) is None:
            held += 1
            held_by[index] = held
            total = held_by[0] + held_by[1]
            if total > limit:
                violations[index] += 1
        if held and (i % 3 == 0 or held >= limit):
            held -= 1
            held_by[index] = held
            admission.release(1, 1)
    held_by[index] = 0
    admission.release(held, held)


def test_two_processes_admitting_at_once_never_exceed_the_limit() -> None:
    fd, (r0, _) = _views(2)
    ctx = multiprocessing.get_context("fork")
    violations = ctx.Array("q", 2, lock=False)
    held_by = ctx.Array("q", 2, lock=False)
    procs = [ctx.Process(target=_hammer, args=(fd, i, 20_000, 4, held_by, violations)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert list(violations) == [0, 0], "more admitted than the limit"
    admission = SharedAdmission(r0, 4, None)
    assert admission.queued_reqs == 0 and admission.queued_tokens == 0  # every admit released: never undercounted
    os.close(fd)


def test_metrics_are_summed_over_processes_and_engine_values_reported_once() -> None:
    from engine.messages import EngineStats

    fd, regions = _views(2)
    metrics = [ServerMetrics("m"), ServerMetrics("m")]
    for m, r in zip(metrics, regions):
        share_metrics(m, r)
    for m, tokens in zip(metrics, (64, 96)):
        for _ in range(tokens // 16):
            m.generation_tokens.inc(16)
            m.record_finished(
                reason="length",
                arrival=1.0,
                scheduled=1.5,
                first_token=2.0,
                finished=3.0,
                num_prompt_tokens=4,
                num_output_tokens=16,
            )
        m.ttft.observe(0.05)
        m.record_stats(EngineStats(3, 2, 10, 100, 1, 50, 20, 7))  # the same engine, seen by both processes
    m.rejected("queue_full")
    for m in metrics:  # every process shows the same totals
        text = m.render().decode()
        assert 'spindle_generation_tokens_total{model_name="m"} 160.0' in text
        assert 'spindle_request_success_total{finished_reason="length",model_name="m"} 10.0' in text
        assert 'spindle_prompt_tokens_total{model_name="m"} 40.0' in text
        assert 'spindle_requests_rejected_total{model_name="m",reason="queue_full"} 1.0' in text
        assert 'spindle_time_to_first_token_seconds_count{model_name="m"} 2.0' in text
        assert 'spindle_e2e_request_latency_seconds_count{model_name="m"} 10.0' in text
        assert 'spindle_e2e_request_latency_seconds_sum{model_name="m"} 20.0' in text
        assert 'spindle_num_requests_running{model_name="m"} 3.0' in text  # gauges: the engine's, once
        assert 'spindle_prefix_cache_queries_total{model_name="m"} 50.0' in text  # the engine's total, once
        assert 'spindle_mm_encoder_cache_hits_total{model_name="m"} 7.0' in text  # an engine total too: once
        assert 'spindle_api_server_requests_total{api_server="0",model_name="m"} 4.0' in text
        assert 'spindle_api_server_requests_total{api_server="1",model_name="m"} 6.0' in text
    os.close(fd)


def test_routed_counts_per_engine_are_summed_and_clear_of_the_metrics() -> None:
    fd, (a, b) = _views(2)
    share_metrics(ServerMetrics("tiny"), a)  # its counters and histograms leave the engine values alone
    mine, theirs = engine_routed(a, 2), engine_routed(b, 2)
    mine[0].inc(1)
    theirs[0].inc(2)
    theirs[1].inc(1)
    assert [v.get() for v in mine] == [v.get() for v in theirs] == [3, 1]
    assert [v.get_own() for v in mine] == [1, 0]
    os.close(fd)


def test_sharing_keeps_what_was_counted_before() -> None:
    fd, (a, b) = _views(2)
    first, second = ServerMetrics("m"), ServerMetrics("m")
    first.generation_tokens.inc(5)
    first.itl.observe(0.03)
    share_metrics(first, a)
    share_metrics(second, b)
    second.generation_tokens.inc(2)
    second.itl.observe(0.03)
    text = second.render().decode()
    assert 'spindle_generation_tokens_total{model_name="m"} 7.0' in text
    assert 'spindle_inter_token_latency_seconds_bucket{le="0.04",model_name="m"} 2.0' in text
    assert first.generation_tokens.get_own() == 5 and second.generation_tokens.get_own() == 2
    os.close(fd)
