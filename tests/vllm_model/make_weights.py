"""Writes the weights of the tiny Llama in ``config.json`` as safetensors.

Every matrix is drawn from a normal distribution with variance 1/fan_in
(fixed seed), so activations keep their scale through the layers and the
greedy output depends on the whole context, not only on the last token.
Norm weights are ones. Same seed, same bytes.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent


def make(out_dir: Path, seed: int = 1234) -> Path:
    """Creates ``out_dir`` holding config.json and model.safetensors; returns it."""
    config = json.loads((HERE / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    vocab = config["vocab_size"]
    generator = torch.Generator().manual_seed(seed)

    def normal(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator) / cols**0.5).contiguous()

    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{prefix}.self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        tensors[f"{prefix}.self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[f"{prefix}.self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        tensors[f"{prefix}.mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[f"{prefix}.mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[f"{prefix}.mlp.down_proj.weight"] = normal(hidden, inter)
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = normal(vocab, hidden)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "config.json", out_dir / "config.json")
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
