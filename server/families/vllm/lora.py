"""vLLM's runtime adapter routes, served only with SPINDLE_ALLOW_RUNTIME_LORA_UPDATING=1:
POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace?} and POST /v1/unload_lora_adapter {lora_name}.

A missing or bad adapter is a 400 naming why and changes nothing; a name already loaded needs load_inplace
(the new weights get a new digest, so no KV of the old ones is served: engine/core/block_manager.py); an unknown
unload is a 404. An unload takes the name away from new requests at once; requests already sent finish under
the adapter. Success is vLLM's plain-text line.
"""

from __future__ import annotations

import anyio
import msgspec

from engine.lora.peft_files import AdapterError
from server.app_state import decode_body
from server.http.asgi import Send
from server.http.errors import APIError, bad_request
from server.lora.adapters import LoRARegistry
from server.request.post_route import PostRoute


class LoadLoRAAdapter(msgspec.Struct):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapter(msgspec.Struct):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what spindle keys on


_load_decoder = msgspec.json.Decoder(LoadLoRAAdapter)
_unload_decoder = msgspec.json.Decoder(UnloadLoRAAdapter)


async def _send_text(send: Send, text: str) -> None:
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _LoRARoute(PostRoute):
    def registry(self) -> LoRARegistry:
        _llm, _renderer, limits = self.state.require()
        if limits.loras is None:  # the config refuses runtime updates without --enable-lora; a test's stand-in
            raise APIError("LoRA is not enabled on this server; start it with --enable-lora", status=400)
        return limits.loras


class LoadLoRARoute(_LoRARoute):
    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req = decode_body(_load_decoder, body)
        registry = self.registry()
        if not req.lora_name or not req.lora_path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        if req.lora_name in registry.adapters and not req.load_inplace:
            raise bad_request(
                f"The lora adapter '{req.lora_name}' has already been loaded. If you want to load "
                "the adapter in place, set 'load_inplace' to True.",
                "lora_name",
            )
        try:
            adapter = await anyio.to_thread.run_sync(registry.check, req.lora_name, req.lora_path)
        except AdapterError as e:
            raise bad_request(f"cannot load LoRA adapter '{req.lora_name}': {e}", "lora_path") from None
        try:  # in a thread: with several API processes the set is a shared file (server/lora/shared.py)
            await anyio.to_thread.run_sync(lambda: registry.add(adapter, replace=req.load_inplace))
        except AdapterError as e:  # loaded meanwhile by another request
            raise bad_request(str(e), "lora_name") from None
        await _send_text(send, f"Success: LoRA adapter '{req.lora_name}' added successfully.")


class UnloadLoRARoute(_LoRARoute):
    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req = decode_body(_unload_decoder, body)
        registry = self.registry()
        if not await anyio.to_thread.run_sync(registry.remove, req.lora_name):
            raise APIError(f"The lora adapter '{req.lora_name}' cannot be found.", status=404, param="lora_name")
        await _send_text(send, f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
