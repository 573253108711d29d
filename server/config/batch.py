"""The Batch API (/v1/files, /v1/batches): where its files and state live, the upload limit, how many lines run at
once."""

from __future__ import annotations

from dataclasses import dataclass

from server.config.values import check_at_least_one


@dataclass(frozen=True)
class BatchConfig:
    batch_dir: str | None = None  # uploaded files, batch state and results; None: <spindle cache>/batches
    batch_max_file_bytes: int = 200 << 20  # the largest upload to /v1/files (413 past it), OpenAI's 200 MB
    batch_max_in_flight: int = 4  # batch lines in the engine at once, all batches together

    def __post_init__(self) -> None:
        check_at_least_one(self, ("batch_max_file_bytes", "batch_max_in_flight"))
        if self.batch_dir is not None and not str(self.batch_dir).strip():
            raise ValueError("--batch-dir must name a folder")
