"""--speculative-config ngram with --tensor-parallel-size 2 through the real server: greedy answers identical to a
TP=2 server without it, chat and completions, streamed or not, n > 1, stop strings, logprobs; drafts are accepted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Server, start_server
from tests.e2e.test_speculative import BODIES, SPEC, TEXT, answers, close, post, streamed
from tests.e2e.test_speculative_draft import streamed_chat


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    from demo.checkpoints import demo_checkpoint_path  # its greedy output repeats itself: drafts land

    model: Path = demo_checkpoint_path()
    tmp = tmp_path_factory.mktemp("spec-tp")
    plain = start_server(model, tmp, "--tensor-parallel-size", "2")
    spec = start_server(model, tmp, "--tensor-parallel-size", "2", "--speculative-config", SPEC)
    yield plain, spec
    plain.stop()
    spec.stop()


def test_same_answers_with_and_without_under_tp2(servers: tuple[Server, Server]) -> None:
    plain, spec = servers
    for path, body in BODIES:
        assert close(answers(post(spec, path, body)), answers(post(plain, path, body))), (path, body)
    body = {"prompt": TEXT, "max_tokens": 40, "temperature": 0}
    assert streamed(spec, body) == streamed(plain, body)
    chat = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 30, "temperature": 0}
    assert streamed_chat(spec, chat) == streamed_chat(plain, chat)
    assert spec.metric("spindle_spec_decode_num_accepted_tokens_total") > 0
    assert spec.metric("spindle_spec_decode_num_drafts_total") > 0
