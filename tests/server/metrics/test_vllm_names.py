"""--metrics-compat vllm: vLLM's names, types and labels (vllm/v1/metrics/loggers.py) beside spindle's own."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.messages import EngineStats
from server.metrics.prometheus import ServerMetrics
from server.metrics.vllm_names import export_vllm_names

# What vLLM v1 exposes (name -> type), for the metrics routers and autoscalers read.
VLLM = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}


def families(metrics: ServerMetrics) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_vllm_names_types_and_labels() -> None:
    m = ServerMetrics("tiny")
    export_vllm_names(m)
    m.record_stats(EngineStats(2, 3, 0, 10, 4, 100, 60))
    m.generation_tokens.inc(7)
    m.ttft.observe(0.05)
    m.record_finished(
        reason="stop",
        arrival=1.0,
        scheduled=1.1,
        first_token=1.2,
        finished=2.0,
        num_prompt_tokens=5,
        num_output_tokens=4,
    )
    found = families(m)
    for name, kind in VLLM.items():
        assert name in found, name
        fam = found[name]
        assert fam.type == kind, (name, fam.type)  # type: ignore[attr-defined]
        for sample in fam.samples:  # type: ignore[attr-defined]
            assert sample.labels["model_name"] == "tiny" and sample.labels["engine"] == "0", sample
    value = {
        s.name: s.value
        for f in found.values()
        for s in f.samples  # type: ignore[attr-defined]
        if not s.labels.get("finished_reason") or s.labels["finished_reason"] == "stop"
    }
    assert value["vllm:num_requests_running"] == 2 and value["vllm:num_requests_waiting"] == 3
    assert value["vllm:prefix_cache_queries_total"] == 100 and value["vllm:prefix_cache_hits_total"] == 60
    assert value["vllm:generation_tokens_total"] == 7 and value["vllm:prompt_tokens_total"] == 5
    assert value["vllm:request_success_total"] == 1
    assert value["vllm:time_to_first_token_seconds_count"] == 1
    assert value["spindle_time_to_first_token_seconds_count"] == 1  # spindle's own names stay


def test_off_by_default() -> None:
    assert not any(name.startswith("vllm:") for name in families(ServerMetrics("tiny")))
