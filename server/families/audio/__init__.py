"""Speech to text: /v1/audio/transcriptions and /v1/audio/translations (a Whisper checkpoint)."""

from server.families import ErrorShape, Family

FAMILY = Family("audio", ErrorShape.OPENAI)
