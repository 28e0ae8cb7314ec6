"""Test helpers: tiny random-weight Hugging Face checkpoints and hand-built paged batches.

`write_tiny_model` saves a model of any supported family with transformers' own classes as fp32
safetensors, so tests can load it with our loader and use transformers as the reference.
`PagedBatch` plays the model runner's part by hand: shuffled block ids per request, slot
mapping, block tables and `AttentionMetadata` for one flattened ragged step at a time;
`run_step` runs a model over one such step.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from engine_core.config import ModelArchConfig
from kernels import AttentionMetadata

# model_type -> transformers (config class, causal-LM class)
FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}


def write_tiny_model(
    folder: str | Path,
    *,
    model_type: str = "llama",
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 256,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    seed: int = 0,
    **family_options,
) -> Path:
    """Write config.json + model.safetensors of a random tiny model; returns the folder.
    `family_options` go to the family's transformers config as they are."""
    import transformers

    config_name, model_name = FAMILY_CLASSES[model_type]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    if rope_scaling is not None:
        family_options["rope_scaling"] = rope_scaling
    config = config_cls(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.1,  # larger than the default 0.02, so logits are far from zero
        bos_token_id=1,
        eos_token_id=[2, 3],
        **family_options,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():  # random norm weights too, so a missed norm would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return Path(folder)


class PagedBatch:
    """Paged KV caches plus per-request bookkeeping for hand-built forward steps."""

    def __init__(
        self, config: ModelArchConfig, num_requests: int, max_len: int, block_size: int = 4, seed: int = 0
    ) -> None:
        blocks_per_req = -(-max_len // block_size)
        num_blocks = 1 + num_requests * blocks_per_req  # block 0 is the null block
        ids = list(range(1, num_blocks))
        random.Random(seed).shuffle(ids)
        self.block_size = block_size
        self.block_tables = torch.tensor(ids, dtype=torch.int32).view(num_requests, blocks_per_req)
        self.lens = [0] * num_requests
        shape = (num_blocks, config.num_key_value_heads, block_size, config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)
        ]

    def step(self, chunks: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """chunks: (request index, new token ids), decodes (one token) first.

        Returns input_ids [T], positions [T] and the metadata, and advances each request.
        """
        num_decodes = sum(1 for _, tokens in chunks if len(tokens) == 1)
        assert all(len(tokens) == 1 for _, tokens in chunks[:num_decodes]), "decodes must come first"
        input_ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for req, tokens in chunks:
            start = self.lens[req]
            self.lens[req] += len(tokens)
            for pos in range(start, self.lens[req]):
                block = int(self.block_tables[req, pos // self.block_size])
                slots.append(block * self.block_size + pos % self.block_size)
                positions.append(pos)
            input_ids += tokens
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(self.lens[req])
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=self.block_tables[[req for req, _ in chunks]],
            max_query_len=max(len(tokens) for _, tokens in chunks),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        return torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), metadata


@torch.inference_mode()
def run_step(model, batch: PagedBatch, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
    """One forward step of `model` over `chunks`; float32 logits [len(chunk), vocab] per chunk."""
    input_ids, positions, metadata = batch.step(chunks)
    logits = model.compute_logits(model(input_ids, positions, batch.kv_caches, metadata))
    return list(logits.split([len(tokens) for _, tokens in chunks]))
