"""Anthropic's routes: /v1/messages and /v1/messages/count_tokens, a translation layer over the chat path."""

from server.families import ErrorShape, Family

FAMILY = Family("anthropic", ErrorShape.ANTHROPIC)
