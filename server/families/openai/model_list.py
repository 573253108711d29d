"""GET /v1/models."""

from __future__ import annotations

from server.app_state import AppState
from server.http.asgi import Receive, Scope, Send, send_json
from server.request.openai_protocol import ModelCard, ModelList, encoder


class ModelsRoute:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limits = self.state.limits
        max_len = limits.max_model_len if limits is not None else (self.state.config.model.max_model_len or 0)
        card = ModelCard(
            id=self.state.model_name,
            created=self.state.created,
            owned_by="spindle",
            root=self.state.config.model.model or self.state.model_name,
            max_model_len=max_len,
            sampling_defaults=dict(limits.generation_defaults) if limits is not None else None,
        )
        cards = [card]
        loras = limits.loras if limits is not None else None
        if loras is not None:  # vLLM's shape: root is the adapter's folder, parent the base model
            cards += [
                ModelCard(
                    id=a.name,
                    created=a.created,
                    owned_by="spindle",
                    root=a.path,
                    parent=a.parent,
                    max_model_len=max_len,
                )
                for a in loras.adapters.values()
            ]
        await send_json(send, 200, encoder.encode(ModelList(cards)))
