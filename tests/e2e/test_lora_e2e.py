"""LoRA adapters through the real server and the official SDKs: /v1/models, per-request adapters in one mixed
batch equal to transformers + peft, every route resolving `model`, 404s, runtime load / unload, start-up."""

from __future__ import annotations

import concurrent.futures
import shutil
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import Server, start_server
from tests.helpers.engine import hf_greedy
from tests.helpers.lora import peft_greedy, write_adapter

PROMPT = [9707, 11, 1879, 17, 3555, 374, 279, 6722, 315]
N = 6


@pytest.fixture(scope="module")
def adapters(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e-adapters")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "a1": write_adapter(qwen2_ckpt, root / "a1", r=8, targets=["q_proj", "v_proj"], seed=11),
        "a2": write_adapter(qwen2_ckpt, root / "a2", r=16, targets=every, seed=12),
        "a3": write_adapter(qwen2_ckpt, root / "a3", r=4, targets=["o_proj", "down_proj"], seed=13),
        "r32": write_adapter(qwen2_ckpt, root / "r32", r=32, targets=["q_proj"], seed=14),
    }


@pytest.fixture(scope="module")
def srv(qwen2_ckpt: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        qwen2_ckpt,
        tmp_path_factory.mktemp("lora-srv"),
        "--enable-lora",
        "--max-loras",
        "2",
        "--metrics-compat",
        "vllm",
        "--lora-modules",
        f"a1={adapters['a1']}",
        f'{{"name": "a2", "path": "{adapters["a2"]}"}}',
        env={"SPINDLE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    yield s
    s.stop()


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)


def complete(srv: Server, model: str, n: int = 1) -> list[list[int]]:
    out = client(srv).completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=N,
        temperature=0,
        n=n,
        extra_body={"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.0},
    )
    assert out.model == model
    return [c.token_ids for c in out.choices]  # type: ignore[attr-defined]


def test_models_lists_adapters_with_root_and_parent(srv: Server, adapters: dict[str, Path]) -> None:
    cards = {m.id: m for m in client(srv).models.list().data}
    assert set(cards) == {"tiny", "a1", "a2"}
    assert cards["a1"].root == str(adapters["a1"]) and cards["a1"].parent == "tiny"  # type: ignore[attr-defined]


def test_mixed_batch_each_request_equals_peft(srv: Server, qwen2_ckpt: Path, adapters: dict[str, Path]) -> None:
    jobs = [("tiny", 1), ("a1", 1), ("a2", 2), ("a1", 1), ("tiny", 1), ("a2", 1)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: complete(srv, *j), jobs))
    want = {
        "tiny": hf_greedy(qwen2_ckpt, PROMPT, N),
        **{a: peft_greedy(qwen2_ckpt, adapters[a], PROMPT, N) for a in ("a1", "a2")},
    }
    assert len(set(map(tuple, want.values()))) == 3
    for (model, n), got in zip(jobs, results):
        assert got == [want[model]] * n, model  # n > 1 children share the adapter
    assert srv.metric("spindle_lora_requests_total", 'lora_name="a2"') >= 3
    assert srv.metric("spindle_lora_requests_info", 'max_lora="2"') > 0
    assert srv.metric("vllm:lora_requests_info", 'running_lora_adapters=""') > 0  # idle now


def test_every_route_resolves_the_adapter(srv: Server, qwen2_ckpt: Path, adapters: dict[str, Path]) -> None:
    want = peft_greedy(qwen2_ckpt, adapters["a2"], PROMPT, N)
    gen = httpx.post(
        f"{srv.url}/inference/v1/generate",
        timeout=120,
        json={
            "model": "a2",
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": N, "temperature": 0, "repetition_penalty": 1.0, "ignore_eos": True},
        },
    )
    assert gen.status_code == 200, gen.text
    assert gen.json()["choices"][0]["token_ids"] == want
    chat = client(srv).chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert chat.model == "a1" and chat.usage is not None and chat.usage.completion_tokens >= 1
    msg = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0).messages.create(
        model="a2", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
    )
    assert msg.model == "a2"
    resp = client(srv).responses.create(model="a1", input="hi", max_output_tokens=3)
    assert resp.model == "a1" and resp.status in ("completed", "incomplete")


def test_unknown_model_is_a_404_in_each_shape(srv: Server) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client(srv).completions.create(model="nope", prompt="hi", max_tokens=1)
    assert "nope" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client(srv).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0).messages.create(
            model="nope", max_tokens=1, messages=[{"role": "user", "content": "x"}]
        )


def load(srv: Server, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/load_lora_adapter", json=body, timeout=60)


def unload(srv: Server, name: str) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def test_runtime_load_reload_and_unload(
    srv: Server, qwen2_ckpt: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    missing = load(srv, {"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert missing.status_code == 400 and "no adapter folder" in missing.json()["error"]["message"]
    big = load(srv, {"lora_name": "x", "lora_path": str(adapters["r32"])})
    assert big.status_code == 400 and "above --max-lora-rank 16" in big.json()["error"]["message"]
    assert {m.id for m in client(srv).models.list().data} == {"tiny", "a1", "a2"}  # nothing changed
    ok = load(srv, {"lora_name": "x", "lora_path": str(adapters["a3"])})
    assert ok.status_code == 200 and ok.text == "Success: LoRA adapter 'x' added successfully."
    assert complete(srv, "x") == [peft_greedy(qwen2_ckpt, adapters["a3"], PROMPT, N)]
    again = load(srv, {"lora_name": "x", "lora_path": str(adapters["a1"])})
    assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"]
    # new weights under the same name: its outputs follow them (no KV of the old weights is served)
    assert load(srv, {"lora_name": "x", "lora_path": str(adapters["a1"]), "load_inplace": True}).status_code == 200
    assert complete(srv, "x") == [peft_greedy(qwen2_ckpt, adapters["a1"], PROMPT, N)]
    assert unload(srv, "x").status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(srv, "x")
    gone = unload(srv, "x")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"


def test_a_bad_static_adapter_stops_startup(qwen2_ckpt: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "dora"
    shutil.copytree(adapters["a1"], bad)
    cfg = (bad / "adapter_config.json").read_text().replace('"use_dora": false', '"use_dora": true')
    (bad / "adapter_config.json").write_text(cfg)
    s = start_server(qwen2_ckpt, tmp_path, "--enable-lora", "--lora-modules", f"d={bad}", wait=False)
    assert s.proc.wait(120) != 0
    lines = [line for line in s.log.read_text().splitlines() if "DoRA" in line]
    assert lines and f"--lora-modules d={bad}: DoRA adapters (use_dora) are not supported" in lines[0], lines


def test_embeddings_under_an_adapter_equal_peft(qwen2_ckpt: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from tests.helpers.lora import peft_model

    s = start_server(
        qwen2_ckpt, tmp_path, "--runner", "pooling", "--enable-lora", "--lora-modules", f"a2={adapters['a2']}"
    )
    try:
        c = client(s)
        got = {m: np.array(c.embeddings.create(model=m, input=[PROMPT]).data[0].embedding) for m in ("tiny", "a2")}
        out = c.embeddings.create(model="a2", input=[PROMPT])
        assert out.model == "a2"
        with pytest.raises(openai.NotFoundError):
            c.embeddings.create(model="a1", input=[PROMPT])
    finally:
        s.stop()
    with torch.no_grad():
        hidden = peft_model(qwen2_ckpt, adapters["a2"])(torch.tensor([PROMPT]), output_hidden_states=True)
    want = F.normalize(hidden.hidden_states[-1][0, -1], dim=-1).numpy()
    np.testing.assert_allclose(got["a2"], want, atol=1e-4)
    assert not np.allclose(got["tiny"], want, atol=1e-2)


def test_unload_lets_running_requests_finish_under_the_adapter(
    srv: Server, qwen2_ckpt: Path, adapters: dict[str, Path]
) -> None:
    assert load(srv, {"lora_name": "y", "lora_path": str(adapters["a3"])}).status_code == 200
    stream = client(srv).completions.create(
        model="y",
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.0, "return_token_ids": True},
    )
    tokens: list[int] = []
    for i, chunk in enumerate(stream):
        tokens += chunk.choices[0].token_ids or []  # type: ignore[attr-defined]
        if i == 0:
            assert unload(srv, "y").status_code == 200  # while the request runs
    assert tokens == peft_greedy(qwen2_ckpt, adapters["a3"], PROMPT, 40)
    with pytest.raises(openai.NotFoundError):
        complete(srv, "y")


def test_every_api_process_sees_the_same_adapters(qwen2_ckpt: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    """Static ones from the flags, runtime loads and unloads through whichever process took the request (each
    request below is a new connection: the processes share one listening socket)."""
    s = start_server(
        qwen2_ckpt,
        tmp_path,
        "--api-server-count",
        "2",
        "--enable-lora",
        "--lora-modules",
        f"a1={adapters['a1']}",
        env={"SPINDLE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )

    def many(model: str) -> list[object]:
        def one(_: int) -> object:
            try:
                return complete(s, model)
            except openai.NotFoundError:
                return 404

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, range(8)))

    try:
        assert many("a1") == [[peft_greedy(qwen2_ckpt, adapters["a1"], PROMPT, N)]] * 8
        assert load(s, {"lora_name": "z", "lora_path": str(adapters["a3"])}).status_code == 200
        assert many("z") == [[peft_greedy(qwen2_ckpt, adapters["a3"], PROMPT, N)]] * 8
        assert all("z" in {m.id for m in client(s).models.list().data} for _ in range(4))
        again = load(s, {"lora_name": "z", "lora_path": str(adapters["a3"])})
        assert again.status_code == 400
        assert unload(s, "z").status_code == 200
        assert many("z") == [404] * 8
        assert unload(s, "z").status_code == 404
    finally:
        s.stop()
