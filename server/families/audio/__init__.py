"""Speech to text: /v1/audio/transcriptions and /v1/audio/translations (a Whisper checkpoint)."""
