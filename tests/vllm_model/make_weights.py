"""Writes the weights of the tiny Llama in ``config.json`` (or of the tiny
DeepSeek-V2 in ``mla/config.json``: multi-head latent attention, every layer
dense; or of the tiny MiniCPM3 in ``minicpm3/config.json``: the same latent
attention, which SGLang's CPU build runs; or of the tiny Mellum in
``mellum/config.json``: sliding-window and full attention layers, every MLP
dense, a hybrid SWA model to SGLang) as safetensors.

Every matrix is drawn from a normal distribution with variance 1/fan_in
(fixed seed), so activations keep their scale through the layers and the
greedy output depends on the whole context, not only on the last token.
Norm weights are ones. Same seed, same bytes.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent


def make(out_dir: Path, seed: int = 1234, variant: str = "llama", layers: int | None = None) -> Path:
    """Creates ``out_dir`` holding config.json and model.safetensors; returns it.

    ``layers`` overrides the variant's ``num_hidden_layers``: a deeper (or
    shallower) model of the same width, for measurements that need more
    layers; written with its own config.json."""
    source = HERE / (variant if variant in ("mla", "sliding", "minicpm3", "mellum") else ".") / "config.json"
    config = json.loads(source.read_text())
    if layers is not None:
        config["num_hidden_layers"] = layers
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    vocab = config["vocab_size"]
    generator = torch.Generator().manual_seed(seed)

    def normal(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator) / cols**0.5).contiguous()

    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors.update(_attention(config, prefix, normal))
        tensors[f"{prefix}.mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[f"{prefix}.mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[f"{prefix}.mlp.down_proj.weight"] = normal(hidden, inter)
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = normal(vocab, hidden)
    out_dir.mkdir(parents=True, exist_ok=True)
    if layers is None:
        shutil.copy(source, out_dir / "config.json")
    else:
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def _attention(config: dict, prefix: str, normal: Callable[[int, int], torch.Tensor]) -> dict[str, torch.Tensor]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    attn = f"{prefix}.self_attn"
    if "kv_lora_rank" not in config:
        kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
        tensors = {
            f"{attn}.q_proj.weight": normal(heads * head_dim, hidden),
            f"{attn}.k_proj.weight": normal(kv_heads * head_dim, hidden),
            f"{attn}.v_proj.weight": normal(kv_heads * head_dim, hidden),
            f"{attn}.o_proj.weight": normal(hidden, heads * head_dim),
        }
        if config["model_type"] == "mellum":  # Qwen3's per-head norms of q and k
            tensors[f"{attn}.q_norm.weight"] = torch.ones(head_dim)
            tensors[f"{attn}.k_norm.weight"] = torch.ones(head_dim)
        return tensors
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    return {
        f"{attn}.q_a_proj.weight": normal(q_rank, hidden),
        f"{attn}.q_a_layernorm.weight": torch.ones(q_rank),
        f"{attn}.q_b_proj.weight": normal(heads * (nope + rope), q_rank),
        f"{attn}.kv_a_proj_with_mqa.weight": normal(kv_rank + rope, hidden),
        f"{attn}.kv_a_layernorm.weight": torch.ones(kv_rank),
        f"{attn}.kv_b_proj.weight": normal(heads * (nope + v_dim), kv_rank),
        f"{attn}.o_proj.weight": normal(hidden, heads * v_dim),
    }


if __name__ == "__main__":
    print(make(Path(sys.argv[1]), variant=sys.argv[2] if len(sys.argv) > 2 else "llama"))
