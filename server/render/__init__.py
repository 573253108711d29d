"""Text to token ids: chat templates in a sandbox and tokenizers, run in worker processes."""
