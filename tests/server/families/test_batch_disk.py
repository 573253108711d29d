"""The Batch API's input lines, result files and folder lock, without a server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from server.families.batch.disk import claim, page
from server.families.batch.lines import read_lines
from server.families.batch.store import BatchStore, new_batch

URL = "/v1/completions"


def _line(custom_id: str, **over: object) -> bytes:
    item = {"custom_id": custom_id, "method": "POST", "url": URL, "body": {"prompt": "x"}, **over}
    return json.dumps(item).encode()


def test_bad_lines_are_named_by_number_and_never_stop_the_good_ones() -> None:
    data = b"\n".join(
        [
            _line("a"),
            b"{oops",
            _line("a"),
            _line("b", url="/v1/embeddings"),
            _line("c", method="GET"),
            _line("d", body={"prompt": "x", "stream": True}),
            json.dumps({"method": "POST", "url": URL, "body": {}}).encode(),
            b"",
            _line("e"),
        ]
    )
    good, bad = read_lines(data, URL)
    assert [(line.number, line.custom_id) for line in good] == [(1, "a"), (9, "e")]
    assert [(b.number, b.code) for b in bad] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "invalid_url"),
        (5, "invalid_method"),
        (6, "invalid_body"),
        (7, "missing_required_parameter"),
    ]


def test_a_torn_last_result_line_is_cut_and_its_request_runs_again(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    batch = new_batch("file-x", URL, "24h", None)
    store.save(batch)
    store.reset_results(batch["id"])
    store.append(batch["id"], False, {"custom_id": "a", "response": {"status_code": 200}})
    store.append(batch["id"], True, {"custom_id": "a", "response": None, "error": {"code": "duplicate_custom_id"}})
    with store.path(batch["id"], ".out.jsonl").open("ab") as f:
        f.write(b'{"custom_id": "b", "resp')  # a crash mid-append
    done, completed, failed = store.answered(batch["id"])
    assert (done, completed, failed) == ({"a"}, 1, 1)
    assert store.path(batch["id"], ".out.jsonl").read_bytes().endswith(b"}\n")


def test_pages_follow_after() -> None:
    items = [{"id": f"x{i}"} for i in range(5)]
    first = page(items, None, 2)
    assert [i["id"] for i in first["data"]] == ["x0", "x1"] and first["has_more"]
    last = page(items, first["last_id"], 3)
    assert [i["id"] for i in last["data"]] == ["x2", "x3", "x4"] and not last["has_more"]


def test_one_process_owns_a_batch_folder(tmp_path: Path) -> None:
    assert claim(tmp_path)
    probe = "import sys; from pathlib import Path; from server.families.batch.disk import claim; "
    probe += "sys.exit(0 if claim(Path(sys.argv[1])) else 3)"
    other = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], check=False)
    assert other.returncode == 3
