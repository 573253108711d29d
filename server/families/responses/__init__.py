"""OpenAI's Responses API: /v1/responses and its stored responses, a translation layer over the chat path (wire
structs, routes, input items, the store, background runs, the event formatter)."""

from server.families import ErrorShape, Family

FAMILY = Family("responses", ErrorShape.OPENAI)
