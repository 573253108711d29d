"""OpenAI's Batch API: /v1/files (uploads and results on disk) and /v1/batches (a JSONL file of requests run at the
lowest priority, a few at a time, through the same in-process routes as online requests; resumed after a restart)."""

from server.families import ErrorShape, Family

FAMILY = Family("batch", ErrorShape.OPENAI)
