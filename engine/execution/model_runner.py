"""Runs one scheduled step: every sequence's new tokens in one flat forward pass over the paged KV cache."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.execution.lazy_zeros import lazy_zeros
from engine.execution.recurrent_state import make_states
from engine.layers.cpu_attention import DecodeSeqs, PrefillChunk
from engine.layers.linear import Linear
from engine.layers.ops import AttnMetadata
from engine.layers.parallel import WORKERS
from engine.lora.manager import LoRAManager
from engine.models.checkpoint_meta import max_model_len, read_generation_config
from engine.models.decoder import CausalLM
from engine.models.loader import ModelInfo, load_model, read_config, resolve_model, slow_half_precision
from engine.models.qwen2_vl import Qwen2VLCausalLM
from engine.models.step import Step
from engine.models.weights import ModelLoadError
from engine.models.whisper import WhisperModel
from engine.multimodal.audio_runner import AudioRunner
from engine.multimodal.image_runner import ImageRunner
from engine.triton_kernels import build_paged_batch, triton_available
from engine.types.sequence import ScheduledSeq

log = logging.getLogger("engine")


@dataclass
class RunnerOutput:
    # [sampled rows, vocab] float32, in batch order of seqs with .samples (a verification: num_draft + 1 rows
    # each, engine/spec/verify.py); on CPU a view of the runner's buffer: valid until the next execute, and the
    # caller may scribble in it
    logits: torch.Tensor
    # batch index -> [num_new_tokens, vocab] float32 for seqs asking prompt_logprobs while in their prompt;
    # row j holds the logits after token start + j, i.e. the distribution of token start + j + 1.
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttnMetadata
    sample_rows: torch.Tensor | None  # rows of the flat batch the LM head reads; None: all of them
    num_samples: int
    prompt_rows: dict[int, tuple[int, int]]  # batch index -> (first row, rows) needing prompt logits


def projection_macs(model: object) -> int:
    """Multiply-adds per token through the model's projections and stacked expert weights (a MoE counts every
    expert: the step-thread choice needs only the order of magnitude); the embedding and LM head not counted."""
    macs, seen, stack = 0, set(), [model]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Linear):
            macs += obj.in_features * obj.out_features
        elif isinstance(obj, torch.Tensor):
            macs += obj.numel() if obj.dim() == 3 else 0
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("engine.") and hasattr(obj, "__dict__"):
            stack.extend(v for k, v in vars(obj).items() if k not in ("head", "embed", "embed_tokens"))
    return macs


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run torch ops on the calling thread only, for the small ops of a small model's step.

    An OpenMP region waits for all its threads at the end: when another process (the API server)
    holds one of two cores, every tiny op waits a scheduler slice
    (bench/README.md, "One intra-op thread for a small model's step").
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def step_threads(runner: ModelRunner, batch: list[ScheduledSeq]) -> contextlib.AbstractContextManager[None]:
    """The threads a step runs on: the device's own on a GPU; on CPU all of torch's for a step whose products
    are big enough to amortise each op's barrier (a prefill chunk, a large batch) on a machine not too busy for
    a team, else one."""
    if runner.device.type != "cpu":
        return contextlib.nullcontext()
    WORKERS.observe()  # a machine too busy for a team: every step on one thread (engine/layers/parallel.py)
    tokens = sum(s.num_new_tokens for s in batch)
    if not WORKERS.contention.busy and tokens * runner.flops_per_token >= runner.threaded_step_flops:
        return contextlib.nullcontext()
    return one_intra_op_thread()


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


class ModelRunner:
    def __init__(self, config: EngineConfig, *, use_triton: bool | None = None) -> None:
        """use_triton None: the Triton kernels on CUDA when triton imports, the torch reference elsewhere."""
        self.device = pick_device(config.device)
        path = resolve_model(config.model)
        # Read the limit before loading, so the rotary table is sized for max_model_len only.
        self.max_model_len = max_model_len(read_config(path), config.max_model_len)
        # The LM head's chunks (and with split_projections the big projections' parts) are shared by this many
        # threads (torch's thread count at startup); the rest of the step runs on one (see one_intra_op_thread).
        # Set before the load: the projections are cut for this many (engine/layers/linear.py).
        self.head_workers = torch.get_num_threads() if self.device.type == "cpu" else 1
        WORKERS.configure(self.head_workers, config.split_projections)
        self.model, info = self._load(path, config)
        self.flops_per_token = 2 * projection_macs(self.model)
        self.threaded_step_flops = config.threaded_step_flops
        self.vocab_size = info.vocab_size
        self.eos_token_ids = info.eos_token_ids
        self.generation_defaults = info.generation_defaults
        self.model_dtype = info.dtype
        if (why := slow_half_precision(info.dtype, self.device)) is not None:
            log.warning("%s", why)
        self.block_size = config.block_size
        self.dtype = dtype = self.model.dtype
        # K and V, every layer, one block of block_size tokens.
        # a hybrid model: only its attention layers hold KV; its recurrent state pool comes out of the KV budget
        info = replace(info, num_layers=getattr(self.model, "num_kv_layers", info.num_layers))
        # per KV cache (kv heads, head dim): a model whose layers differ or share caches (Gemma 4) lists its own
        shapes = getattr(self.model, "kv_shapes", None) or [(info.num_kv_heads, info.head_dim)] * info.num_layers
        bytes_per_block = 2 * config.block_size * sum(h * d for h, d in shapes) * dtype.itemsize
        self.states, state_bytes = make_states(self.model, config, bytes_per_block, self.device)
        self.num_blocks = config.num_blocks or (config.kv_cache_memory - state_bytes) // bytes_per_block
        if self.num_blocks < 1:
            raise ModelLoadError(
                f"kv_cache_memory {config.kv_cache_memory} bytes holds no block of "
                f"{bytes_per_block} bytes; give the KV cache more memory"
            )
        if use_triton is None:
            use_triton = self.device.type == "cuda" and triton_available()
        self.use_triton = use_triton
        self.kv_cache, self.kv_caches = self._allocate_kv_caches(shapes, config.block_size)
        self._logits: torch.Tensor | None = None
        if use_triton:
            self.model.use_triton()
        # a vision model's image half of each step (engine/multimodal); None for text models
        self.images: ImageRunner | None = None
        if isinstance(self.model, Qwen2VLCausalLM):
            self.images = ImageRunner(self.model)
        self.lora: LoRAManager | None = None  # --enable-lora: adapters per request (engine/lora/)
        if config.enable_lora:
            self.lora = self._make_lora(config)
            self.lora.ctx.use_triton = use_triton
        # a speech model's audio half (engine/multimodal/audio_runner.py): encoder, cross-attention K/V, Whisper's rules
        self.audio: AudioRunner | None = None
        if isinstance(self.model, WhisperModel):
            self.audio = AudioRunner(self.model, read_generation_config(path), self.eos_token_ids[0])

    @property
    def kv_window(self) -> int | None:
        """The largest of the layers' sliding windows when every layer has one, else None: the block manager
        releases the blocks that window has passed (engine/core/block_manager.py)."""
        windows = self.model.layer_windows
        return None if not windows or None in windows else max(w for w in windows if w is not None)

    def _allocate_kv_caches(
        self, shapes: list[tuple[int, int]], block_size: int
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """(the first tensor, each cache's (K, V)): one tensor per distinct (kv_heads, head_dim) of `shapes`, so a
        model whose caches all agree gets one [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, shape in enumerate(shapes):
            groups.setdefault(shape, []).append(i)
        caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        tensors = []
        for (heads, dim), members in groups.items():
            tensors.append(self._allocate_kv_cache(len(members), block_size, heads, dim))
            caches.update({i: (tensors[-1][j, 0], tensors[-1][j, 1]) for j, i in enumerate(members)})
        return tensors[0], [caches[i] for i in range(len(shapes))]

    def _allocate_kv_cache(self, layers: int, block_size: int, heads: int, dim: int) -> torch.Tensor:
        """[layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim], zeroed: padded key positions read
        real blocks with weight 0, and 0 * NaN would poison a row. Head-major storage for the torch path, so a
        gather of blocks is contiguous per kv head (engine/layers/cpu_attention.py); Triton reads it block-major."""
        dims = (layers, 2, self.num_blocks, block_size, heads, dim)
        if self.use_triton:
            return torch.zeros(dims, dtype=self.dtype, device=self.device)
        store_dims = dims[:2] + (dims[4], dims[2], dims[3], dims[5])
        if self.device.type == "cpu":  # zeroed page by page as blocks are first used (1 GiB at once: 0.5 s of CPU)
            store = lazy_zeros(store_dims, self.dtype)
        else:
            store = torch.zeros(store_dims, dtype=self.dtype, device=self.device)
        return store.permute(0, 1, 3, 4, 2, 5)

    def _make_lora(self, config: EngineConfig) -> LoRAManager:
        """The LoRA layers on the model (a tensor-parallel runner slices adapters to its rank)."""
        if isinstance(self.model, WhisperModel):
            raise ModelLoadError("--enable-lora serves decoder-only text models; this is a speech-to-text model")
        dtype = self.dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
        return LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, dtype)

    def _load(self, path: Path, config: EngineConfig) -> tuple[CausalLM, ModelInfo]:
        """The whole model (a tensor-parallel runner loads its shard: engine/distributed/tp_runner.py)."""
        return load_model(
            path, config.dtype, self.device, max_positions=self.max_model_len, quantization=config.quantization
        )

    def _metadata(self, batch: list[ScheduledSeq]) -> tuple[list[int], list[int], AttnMetadata]:
        """The CPU path's metadata: single-token steps batched as decodes, longer ones as prefill chunks."""
        bs, dev = self.block_size, self.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillChunk] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_ctx: list[int] = []
        for s in batch:
            start, n, table = s.start, s.num_new_tokens, s.seq.block_table
            row = len(input_ids)
            input_ids += s.input_ids()
            positions += range(start, start + n)
            if n == 1:  # batched with every other single-token step
                decode_rows.append(row)
                decode_tables.append(table[: start // bs + 1])
                decode_ctx.append(start + 1)
            else:
                blocks = torch.tensor(table[: -(-(start + n) // bs)], dtype=torch.long, device=dev)
                prefills.append(PrefillChunk(row, n, start, blocks))
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        decodes = None
        if decode_rows:
            decodes = DecodeSeqs(torch.tensor(decode_rows, dtype=torch.long, device=dev), decode_ctx, decode_tables, bs)
        return input_ids, positions, AttnMetadata(slot_mapping, decodes, prefills)

    def _paged_metadata(self, batch: list[ScheduledSeq]) -> tuple[list[int], list[int], AttnMetadata]:
        """The Triton path's metadata: block tables and lengths; the kernels do the gathering and masking."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in batch:
            start, end, table = s.start, s.start + s.num_new_tokens, s.seq.block_table
            input_ids += s.input_ids()
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        paged = build_paged_batch(
            [s.seq.block_table for s in batch],
            [s.start + s.num_new_tokens for s in batch],
            [s.num_new_tokens for s in batch],
            bs,
            self.device,
        )
        slot_mapping = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        return input_ids, positions, AttnMetadata(slot_mapping, paged=paged)

    def prepare(self, batch: list[ScheduledSeq]) -> StepInputs:
        """Token ids, positions and attention metadata of the flat batch, and which rows reach the LM head."""
        input_ids, positions, meta = (self._paged_metadata if self.use_triton else self._metadata)(batch)
        sample_rows: list[int] = []
        prompt_rows: dict[int, tuple[int, int]] = {}
        row = 0
        for i, s in enumerate(batch):
            n = s.num_new_tokens
            if s.samples:  # a verification samples its last token's row and each draft token's
                sample_rows += range(row + n - 1 - s.num_draft, row + n)
            if s.seq.params.prompt_logprobs is not None and s.start < s.seq.num_prompt_tokens:
                prompt_rows[i] = (row, n)
            row += n
        dev = self.device
        # every row samples (a pure decode step): the LM head reads hidden as is, no gather
        rows = None if len(sample_rows) == row else torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return StepInputs(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            rows,
            len(sample_rows),
            prompt_rows,
        )

    def _logits_buffer(self, n: int) -> torch.Tensor:
        """[n, head's vocab] float32 reused across steps: fresh 150k-wide logits fault in new pages every step."""
        buf = self._logits
        if buf is None or buf.shape[0] < n:
            buf = self._logits = torch.empty(max(n, 8), self.model.head.vocab, dtype=torch.float32, device=self.device)
        return buf[:n]

    def _forward(self, batch: list[ScheduledSeq], inputs: StepInputs) -> torch.Tensor:
        """The decoder over the flat batch (a vision model's image rows spliced in): hidden states before the norm."""
        if self.lora is None:
            return self._run_model(batch, inputs)
        seqs, row = [], 0
        for s in batch:
            seqs.append((row, s.num_new_tokens, s.seq.lora))
            row += s.num_new_tokens
        self.lora.ctx.mapping = self.lora.prepare(seqs, self.device)
        try:
            return self._run_model(batch, inputs)
        finally:
            self.lora.ctx.mapping = None

    def _run_model(self, batch: list[ScheduledSeq], inputs: StepInputs) -> torch.Tensor:
        step = Step(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if self.states is not None:  # a hybrid model: its recurrent layers read and advance each slot's state
            hidden = self.model.forward(replace(step, states=self.states.step(batch)))
            self.states.finish()
            return hidden
        if self.audio is not None:
            return self.model.forward(replace(step, cross=self.audio.cross_batch(batch)))
        if self.images is not None and any(s.seq.mm is not None for s in batch):
            positions, embeds = self.images.step_inputs(batch, inputs.input_ids)
            return self.model.forward(replace(step, positions=positions, embeds=embeds))
        return self.model.forward(step)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> RunnerOutput:
        """Run the step; the returned logits live in a buffer that the next execute overwrites."""
        inputs = self.prepare(batch)
        hidden = self._forward(batch, inputs)
        if self.audio is not None:  # Whisper's no_speech_prob: the <|startoftranscript|> row's raw logits
            self.audio.note_no_speech(batch, hidden)
        # The LM head only for rows someone reads: it dominates the cost of small models.
        sampled = hidden if inputs.sample_rows is None else hidden[inputs.sample_rows]
        # CPU only; a padded head's extra columns (past the tokenizer's vocabulary) are trimmed by the sampler
        reuse = self.model.head.fills_out and self.model.head.vocab >= self.vocab_size
        out = self._logits_buffer(inputs.num_samples) if reuse else None
        if inputs.num_samples:
            # the process's threads as they are now (another runner in this process may have remade the pool)
            logits = self.model.compute_logits(sampled, out=out, pool=WORKERS.pool, workers=WORKERS.threads)
        else:  # only prompt chunks that end mid-prompt: no row samples, no LM head
            logits = hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        prompt_logits = {i: self.model.compute_logits(hidden[r : r + n]) for i, (r, n) in inputs.prompt_rows.items()}
        return RunnerOutput(logits, prompt_logits)

    @torch.inference_mode()
    def execute_pooling(self, batch: list[ScheduledSeq], all_rows: bool) -> torch.Tensor:
        """Runner "pooling": the final norm's output (before the LM head) as float32, no logits.

        all_rows: every row of the flat batch (CLS, MEAN, ALL, STEP); else the rows that end a prompt, in batch order.
        """
        inputs = self.prepare(batch)
        hidden = self._forward(batch, inputs)
        if not all_rows and inputs.sample_rows is not None:
            hidden = hidden[inputs.sample_rows]
        return self.model.final_norm(hidden).float()
