"""Speculative decoding's counters, from the engine's cumulative totals, under spindle's and vLLM's names."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.messages import EngineStats
from server.metrics.prometheus import ServerMetrics
from server.metrics.vllm_names import export_vllm_names


def samples(m: ServerMetrics) -> dict[tuple[str, str], float]:
    """(sample name, position label) -> value."""
    return {
        (s.name, s.labels.get("position", "")): s.value
        for f in text_string_to_metric_families(m.render().decode())
        for s in f.samples
    }


def test_spec_counters_add_the_engine_deltas() -> None:
    m = ServerMetrics("tiny")
    export_vllm_names(m)
    m.record_stats(
        EngineStats(
            1,
            0,
            0,
            10,
            0,
            0,
            0,
            spec_num_drafts=4,
            spec_num_draft_tokens=12,
            spec_num_accepted_tokens=7,
            spec_accepted_per_pos=[4, 2, 1],
        )
    )
    m.record_stats(
        EngineStats(
            1,
            0,
            0,
            10,
            0,
            0,
            0,
            spec_num_drafts=5,
            spec_num_draft_tokens=15,
            spec_num_accepted_tokens=9,
            spec_accepted_per_pos=[5, 3, 1],
        )
    )
    got = samples(m)
    for prefix in ("spindle_", "vllm:"):
        assert got[prefix + "spec_decode_num_drafts_total", ""] == 5
        assert got[prefix + "spec_decode_num_draft_tokens_total", ""] == 15
        assert got[prefix + "spec_decode_num_accepted_tokens_total", ""] == 9
        assert [got[prefix + "spec_decode_num_accepted_tokens_per_pos_total", str(i)] for i in range(3)] == [5, 3, 1]


def test_zero_without_speculation() -> None:
    m = ServerMetrics("tiny")
    m.record_stats(EngineStats(1, 0, 0, 10, 0, 0, 0))
    got = samples(m)
    assert got["spindle_spec_decode_num_drafts_total", ""] == 0
    assert not any(name.startswith("spindle_spec_decode_num_accepted_tokens_per_pos") for name, _ in got)


def test_data_parallel_sums_positions() -> None:
    from server.engine_pool import sum_stats

    a = EngineStats(1, 0, 0, 10, 0, 0, 0, lora_running=["b"], spec_num_drafts=2, spec_accepted_per_pos=[2, 1])
    b = EngineStats(1, 0, 0, 10, 0, 0, 0, lora_running=["a", "b"], spec_num_drafts=3, spec_accepted_per_pos=[3, 2, 1])
    s = sum_stats([a, b])
    assert s.spec_num_drafts == 5 and s.spec_accepted_per_pos == [5, 3, 1] and s.lora_running == ["a", "b"]
