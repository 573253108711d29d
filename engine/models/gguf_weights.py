"""A GGUF model's tensors by Hugging Face name, as the loader reads a safetensors checkpoint's (`Weights`).

Names map through the gguf package's tensor-name table. Fixes llama.cpp's converter applied on the way in are
undone here: the rotary row permutation of llama's Q and K, and the +1 Gemma's norm weights were stored with.
Projection weights come back as `GGMLWeight` (the file's blocks) when the loader keeps them quantized, else
dequantized to the load dtype.
"""

from __future__ import annotations

import logging
import mmap
import re
from pathlib import Path

import numpy as np
import torch

from engine.gguf.ggml_types import GGMLType
from engine.gguf.header import TensorInfo, open_mapped, read_header
from engine.gguf.tensor import GGMLWeight, concat_rows, dequantize_blocks
from engine.models.checkpoint_meta import ModelLoadError
from engine.models.gguf_layouts import Recipe, layout, rotary_rows
from engine.models.progress import LoadProgress
from engine.models.weights import Weights

log = logging.getLogger("engine")
_EXPERT = re.compile(r"^(?P<block>.*\.experts)\.(?P<e>\d+)\.(?P<w>\w+)$")
_ROW_PERMUTED = {"llama", "smollm3"}  # llama.cpp's converter permutes Q/K rows for these (its rotary layout)
_NORM_PLUS_ONE = {"gemma2", "gemma3"}
_KEPT = ("proj.weight", "model.embed_tokens.weight", "lm_head.weight")  # projections, embedding, head
_FLOATS = {int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)}


class GGUFWeights(Weights):
    """HF name -> tensor over one or many GGUF files (split models), memory-mapped; read as `Weights` is."""

    def __init__(
        self, files: list[Path], dtype: torch.dtype, device: torch.device, *, keep_quantized: bool = False
    ) -> None:
        """keep_quantized: projections, the embedding and the LM head come back as GGMLWeight (CPU kernels compute
        on the blocks; a MoE expert is dequantized: the experts are stacked dense)."""
        # no super().__init__: that one opens safetensors files
        self.dtype, self.device, self.keep_quantized = dtype, device, keep_quantized
        self._maps: list[mmap.mmap] = [open_mapped(f) for f in files]
        headers = [read_header(f, m) for f, m in zip(files, self._maps)]
        self.metadata = headers[0].metadata
        self.arch = headers[0].architecture
        self.tensors: dict[str, tuple[int, TensorInfo]] = {
            name: (i, t) for i, h in enumerate(headers) for name, t in h.tensors.items()
        }
        self.file_bytes = sum(h.tensor_bytes for h in headers)
        blocks = int(self.metadata.get(f"{self.arch}.block_count", 0))
        import gguf  # why late: gguf imports mistral_common (+0.5 s); only a GGUF model needs it

        self._names = gguf.get_tensor_name_map(
            next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.arch), blocks
        )
        self._layout = layout(self.arch, self.metadata)  # Qwen3.5, Granite 4.0-H, Gemma 4: recipes
        self.held_bytes = 0
        self.progress = LoadProgress(len(self.tensors))

    def _gguf_name(self, name: str) -> tuple[str, int | None] | None:
        """(the GGUF tensor, the expert index within it) for an HF name, or None."""
        stem, dot, suffix = name.rpartition(".")
        expert = None
        if m := _EXPERT.match(stem):  # one expert of a MoE block: a slice of the stacked *_exps tensor
            stem, expert = f"{m['block']}.{m['w']}", int(m["e"])
        mapped = self._names.get_name(stem) if dot else None
        if mapped is None or f"{mapped}.{suffix}" not in self.tensors:
            return None
        return f"{mapped}.{suffix}", expert

    def _recipe(self, name: str) -> Recipe | None:
        recipe = self._layout(name) if self._layout is not None else None
        return recipe if recipe is not None and all(p in self.tensors for p in recipe.parts) else None

    def __contains__(self, name: str) -> bool:
        if self._layout is not None:
            return self._recipe(name) is not None
        return self._gguf_name(name) is not None

    def _blocks(self, info: TensorInfo, index: int, expert: int | None) -> tuple[np.ndarray, tuple[int, ...]]:
        """The tensor's bytes as [rows, row_bytes] (one expert's when `expert` is given) and its torch shape."""
        raw = np.frombuffer(self._maps[index], dtype=np.uint8, count=info.nbytes, offset=info.offset)
        shape = info.shape if info.shape else (1,)
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        data = raw.reshape(rows, -1)
        if expert is not None:
            per = rows // shape[0]
            data, shape = data[expert * per : (expert + 1) * per], shape[1:]
        return data, tuple(shape)

    def __call__(self, name: str) -> torch.Tensor:
        if self._layout is not None:
            return self._from_recipe(name)
        found = self._gguf_name(name)
        if found is None:
            raise ModelLoadError(f"weight {name!r} has no tensor in the GGUF file ({self.arch})")
        gguf_name, expert = found
        index, info = self.tensors[gguf_name]
        data, shape = self._blocks(info, index, expert)
        rows = self._row_order(gguf_name, shape)
        if (
            self.keep_quantized
            and expert is None
            and len(shape) == 2
            and info.ggml_type not in _FLOATS
            and name.endswith(_KEPT)
        ):
            blocks = torch.from_numpy(np.array(data))
            blocks = blocks if rows is None else blocks[rows].contiguous()
            held = GGMLWeight(info.ggml_type, (shape[0], shape[1]), blocks)
            self.held_bytes += held.nbytes
            self.progress.advance()
            return held  # type: ignore[return-value]  # the quantized linears take it (engine/layers/quant_linear.py)
        dense = dequantize_blocks(data, info.ggml_type, torch.float32).reshape(shape)
        if rows is not None:
            dense = dense[rows]
        if self.arch in _NORM_PLUS_ONE and gguf_name.endswith("norm.weight"):
            dense = dense - 1
        tensor = dense.to(device=self.device, dtype=self.dtype).contiguous()
        self.held_bytes += tensor.numel() * tensor.element_size()
        self.progress.advance()
        return tensor

    def _from_recipe(self, name: str) -> torch.Tensor:
        """An HF weight through its architecture's recipe (engine/models/gguf_layouts.py)."""
        recipe = self._recipe(name)
        if recipe is None:
            raise ModelLoadError(f"weight {name!r} has no tensor in the GGUF file ({self.arch})")
        parts = [
            self._blocks(self.tensors[p][1], self.tensors[p][0], None) + (self.tensors[p][1],) for p in recipe.parts
        ]
        if self.keep_quantized and recipe.keep and recipe.dim == 0:
            held = self._held_blocks(parts, recipe.rows)
            if held is not None:
                self.held_bytes += held.nbytes
                self.progress.advance(len(parts))
                return held  # type: ignore[return-value]  # the quantized linears take it
        dense = torch.cat(
            [dequantize_blocks(d, i.ggml_type, torch.float32).reshape(shape) for d, shape, i in parts], dim=recipe.dim
        )
        if recipe.rows is not None:
            dense = dense[recipe.rows]
        if recipe.cols is not None:
            dense = dense[..., recipe.cols]
        if recipe.value is not None:
            dense = recipe.value(dense)
        if recipe.shape is not None:
            dense = dense.reshape(recipe.shape)
        tensor = dense.to(device=self.device, dtype=self.dtype).contiguous()
        self.held_bytes += tensor.numel() * tensor.element_size()
        self.progress.advance(len(parts))
        return tensor

    @staticmethod
    def _held_blocks(
        parts: list[tuple[np.ndarray, tuple[int, ...], TensorInfo]], rows: torch.Tensor | None
    ) -> GGMLWeight | None:
        """The parts as one weight of the file's blocks (rows concatenated, then reordered), or None where one is
        not a 2-D quantized tensor or their types differ."""
        if any(len(shape) != 2 or info.ggml_type in _FLOATS for _, shape, info in parts):
            return None
        weights = [GGMLWeight(i.ggml_type, (s[0], s[1]), torch.from_numpy(np.array(d))) for d, s, i in parts]
        joined = concat_rows(weights)
        if not isinstance(joined, GGMLWeight):
            return None
        if rows is None:
            return joined
        return GGMLWeight(joined.ggml_type, joined.shape, joined.data[rows].contiguous())

    def _row_order(self, gguf_name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        if self.arch not in _ROW_PERMUTED or not gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            return None
        heads = int(self.metadata[f"{self.arch}.attention.head_count"])
        if ".attn_k." in gguf_name:
            heads = int(self.metadata.get(f"{self.arch}.attention.head_count_kv", heads))
        return rotary_rows(shape[0], heads)

    def log_held(self) -> None:
        """The start-up line: weight bytes held against the file's tensor bytes."""
        ratio = self.held_bytes / max(self.file_bytes, 1)
        log.info(
            "GGUF weights: %.1f MB held (%s) for %.1f MB of tensors in the file (%.2fx)",
            self.held_bytes / 1e6,
            "quantized blocks kept"
            if self.keep_quantized
            else f"dequantized to {str(self.dtype).removeprefix('torch.')}",
            self.file_bytes / 1e6,
            ratio,
        )
