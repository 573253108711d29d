"""The full server's lifespan work, for server/app.py's create_app: open the renderer, a vision or speech model's
worker, the static LoRA adapters and the engine(s) (its own process, an API process's channels to the launcher's
engines, or a test's stand-in), start AsyncLLM and publish them in the AppState the routes read.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from engine.client.process_client import open_engine as open_engine_process
from engine.multimodal.processing import ENCODER_CACHE_BYTES
from server.app_state import AppState
from server.config import ServerConfig
from server.engine_pool import EnginePool, open_engines
from server.lora.adapters import LoRARegistry
from server.lora.shared import SharedAdapters
from server.metrics.prometheus import ServerMetrics
from server.metrics.vllm_names import export_vllm_names
from server.multimodal.audio import open_audio_worker, speech_support
from server.multimodal.images import image_support, open_image_worker
from server.multimodal.mirror import EngineImageMirror
from server.render.renderer import Renderer, load_chat_template
from server.request.admission import Admission
from server.request.async_llm import AsyncLLM, detokenizer_factory
from server.request.input_processor import limits_for
from server.startup_stage import enter as stage
from server.startup_stage import report_stages
from server.tools.parser_names import get_tool_parser, template_fits
from server.worker_context import WorkerContext

log = logging.getLogger("spindle.server")

EngineFactory = Callable[[ServerConfig], AbstractAsyncContextManager[Any]]
RendererFactory = Callable[[ServerConfig], AbstractAsyncContextManager[Any]]


@asynccontextmanager
async def open_image_worker_for(config: ServerConfig) -> AsyncIterator[Any]:
    """A vision checkpoint's image worker process, a speech model's audio worker (None for a text-only model)."""
    if config.model.model is not None and speech_support(config.model.model) is not None:
        async with open_audio_worker(config.model.model, int(config.media.mm_processor_cache_gb * (1 << 30))) as pool:
            yield pool
        return
    support = image_support(config.model.model) if config.model.model is not None else None
    if support is None:
        yield None
        return
    async with open_image_worker(support, int(config.media.mm_processor_cache_gb * (1 << 30))) as pool:
        yield pool


def _warn_tool_parser_misfit(config: ServerConfig) -> None:
    """One log line when --tool-call-parser's markers are absent from the chat template (a wrong parser is silent)."""
    name = config.outputs.tool_call_parser
    if name is None:
        return
    try:
        template = load_chat_template(
            config.model.chat_template, Path(config.model.tokenizer or config.model.model_path)
        )
    except (OSError, ValueError):
        return  # the renderer reports a broken template
    if not template_fits(name, template):
        log.warning(
            "--tool-call-parser %s: the chat template holds none of its tool-call markers (%s); the model "
            "may write calls this parser cannot read",
            name,
            ", ".join(get_tool_parser(name).markers),
        )


def open_model_renderer(config: ServerConfig) -> AbstractAsyncContextManager[Any]:
    _warn_tool_parser_misfit(config)
    return Renderer.open(
        config.model.model_path,
        tokenizer_dir=config.model.tokenizer,
        chat_template=config.model.chat_template,
        num_workers=config.model.renderer_num_workers,
        render_timeout=config.model.chat_template_render_timeout,
        default_chat_template_kwargs=config.model.default_chat_template_kwargs,
        trust_request_chat_template=config.model.trust_request_chat_template,
    )


def server_metrics(config: ServerConfig, worker: WorkerContext | None) -> ServerMetrics:
    metrics = ServerMetrics(config.model.model_name)
    if worker is not None:  # request counters and histograms summed over the API processes
        worker.share_metrics(metrics)
    if config.lora.enable_lora:
        metrics.enable_lora(config.lora.max_loras)
    if config.outputs.metrics_compat == "vllm":
        export_vllm_names(metrics)
    return metrics


class EngineLoad:
    """The full server's lifespan work: load the renderer and the engine(s), publish them in `state`, serve."""

    def __init__(
        self,
        state: AppState,
        metrics: ServerMetrics,
        worker: WorkerContext | None,
        engine_factory: EngineFactory | None,
        open_renderer: RendererFactory,
        fatal: Callable[[str], None],
    ) -> None:
        self.state, self.metrics, self.worker = state, metrics, worker
        self.engine_factory, self.open_renderer, self.fatal = engine_factory, open_renderer, fatal

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load, publish, then serve until cancelled; the log says which stage runs until then."""
        async with anyio.create_task_group() as reporting:
            reporting.start_soon(report_stages, self.state)
            await self._load_and_serve(task_status)

    async def _load_and_serve(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        cfg = self.state.config
        if self.engine_factory is None:  # builds the demo, or derives a GGUF model's folder, on first use
            stage(self.state, "preparing the model's files (a GGUF file's config and tokenizer are derived once)")
            cfg = await anyio.to_thread.run_sync(cfg.resolved)
        self.state.config = cfg
        async with AsyncExitStack() as stack:
            stage(self.state, "starting the chat-template renderer")
            renderer = await stack.enter_async_context(self.open_renderer(cfg))
            self.state.mm_pool = await stack.enter_async_context(open_image_worker_for(cfg))
            loras = None
            if cfg.lora.enable_lora:  # the static adapters, checked before the engine loads: a bad one stops start-up
                loras = await anyio.to_thread.run_sync(
                    LoRARegistry.from_files,
                    cfg.model.model_path,
                    cfg.lora.max_lora_rank,
                    cfg.model.model_name,
                    cfg.lora.lora_modules,
                )
                if self.worker is not None and self.worker.responses_dir is not None:  # the launcher's shared folder
                    loras.shared = SharedAdapters(self.worker.responses_dir)
            stage(self.state, "loading the model and timing its kernels in the engine (its log lines say how far)")
            client = await stack.enter_async_context(self._open_engines(cfg))
            tokenizer = getattr(renderer, "tokenizer", None)
            llm = self._make_llm(cfg, client, tokenizer)
            async with anyio.create_task_group() as tg:
                await tg.start(llm.run)
                state = self.state
                limits = dataclasses.replace(limits_for(cfg, client.ready, tokenizer), loras=loras)
                state.renderer, state.limits, state.llm = renderer, limits, llm
                state.tasks = tg
                log.info("serving %s (max_model_len %d)", state.model_name, state.limits.max_model_len)
                defaults, source = cfg.model.sampling_defaults(dict(client.ready.generation_defaults))
                log.info("sampling defaults for fields a request leaves out: %s, from %s", defaults or "none", source)
                # What startup built (tokenizer, templates, modules) lives for the process: keep full
                # collections from walking it again (bench/README.md, "gc.freeze after start-up").
                gc.collect()
                gc.freeze()
                state.mark_ready()
                task_status.started()
                await anyio.sleep_forever()

    def _open_engines(self, cfg: ServerConfig) -> AbstractAsyncContextManager[Any]:
        """A test's stand-in; an API process's channels to the launcher's engines; or the engine process(es)."""
        if self.engine_factory is not None:
            return open_engines(self.engine_factory, cfg, self.metrics)
        worker = self.worker
        if worker is None:
            return open_engines(_open_engine_process, cfg, self.metrics)

        @asynccontextmanager
        async def channels() -> AsyncIterator[Any]:
            async with open_engines(
                worker.open_engine, cfg, self.metrics, open_nth=lambda i: worker.open_engine(cfg, i)
            ) as client:
                if isinstance(client, EnginePool):  # routed counts summed over the API processes
                    client.shared_routed = worker.engine_routed(client.num_engines)
                yield client

        return channels()

    def _make_llm(self, cfg: ServerConfig, client: Any, tokenizer: Any) -> AsyncLLM:
        llm = AsyncLLM(
            client,
            detokenizer_factory(tokenizer),
            admission=self._admission(cfg),
            stream_interval=cfg.outputs.stream_interval,
            on_dead=self.fatal,
            metrics=self.metrics,
            stopping=self.state.stopping,
        )
        support = (
            image_support(cfg.model.model) if self.state.mm_pool is not None and cfg.model.model is not None else None
        )
        if support is not None:  # what the engine's encoder cache holds, mirrored to send each image once
            llm.images = EngineImageMirror(ENCODER_CACHE_BYTES, support.hidden_size, client.ready.model_dtype)
        return llm

    def _admission(self, cfg: ServerConfig) -> Admission | None:
        if cfg.scheduling.max_num_queued_reqs is None and cfg.scheduling.max_num_queued_tokens is None:
            return None
        if self.worker is not None:  # the limits hold for all API processes together (server/shared_state.py)
            return self.worker.admission(cfg)
        return Admission(cfg.scheduling.max_num_queued_reqs, cfg.scheduling.max_num_queued_tokens)


def _open_engine_process(config: ServerConfig) -> AbstractAsyncContextManager[Any]:
    return open_engine_process(
        config.engine_config(),
        ready_timeout=config.engine.engine_ready_timeout,
        heartbeat_timeout=config.engine.engine_heartbeat_timeout,
        step_timeout=config.engine.engine_step_timeout,
    )
