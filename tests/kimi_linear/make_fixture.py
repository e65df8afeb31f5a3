#!/usr/bin/env python3
"""Writes the Kimi Linear fixture that tests/kimi_linear/kimi_linear_test.cpp checks Terrace against.

A tiny random KimiLinearForCausalLM (transformers' native implementation: KDA + NoPE MLA + MoE, dense
first layer, SiLU experts, low-rank output gate) is saved with `save_pretrained` (safetensors, fp32)
into `checkpoint/`, and its fp32 logits for fixed token ids into `expected.safetensors`; a second
one whose MLA layers use a low-rank query (q_lora_rank 16: q_a_proj, q_a_layernorm, q_b_proj, as
K3 does) into `checkpoint_qlora/` and `expected_qlora.safetensors`:
  input_ids  I32 [T]          the prompt
  logits     F32 [T, vocab]   transformers' logits for every position

Needs torch and transformers >= 5 (not the test: it only reads the files). Run from anywhere:
  python tests/kimi_linear/make_fixture.py [--out DIR]
The weights are re-drawn with a fixed seed at O(1) scale (transformers' own init, std 0.02, gives
near-constant logits that would hide mistakes), so the same versions give the same bytes.
"""
import argparse
import json
import math
import pathlib
import shutil

import torch
import transformers
from safetensors.torch import save_file
from transformers import KimiLinearConfig, KimiLinearForCausalLM

HERE = pathlib.Path(__file__).resolve().parent
VOCAB = 64
HIDDEN = 32
TOKENS = 70  # more than one 64-token KDA chunk


def tiny_config(q_lora_rank) -> KimiLinearConfig:
    return KimiLinearConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,           # dense layer 0
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        routed_scaling_factor=2.446,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        linear_attn_config={
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "full_attn_layers": [2, 4],   # 1-based: layers 1 and 3 are MLA
            "kda_layers": [1, 3],
        },
        first_k_dense_replace=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """O(1)-scale weights: linear N(0, 1/fan_in), norms 1 + N(0, 0.1), embeddings N(0, 1), conv taps
    N(0, 0.3) + 1 on the current token, router bias N(0, 0.1), KDA gates in their usual range."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(math.log(1.0), math.log(4.0), generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty_like(p).uniform_(-4.0, -2.0, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                w = 0.3 * torch.randn(p.shape, generator=gen)
                w[..., -1] += 1.0
                p.copy_(w)
            elif p.dim() >= 2:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
            else:
                p.copy_(torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def write(out: pathlib.Path, suffix: str, q_lora_rank, seed: int) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(seed)
    model = KimiLinearForCausalLM(tiny_config(q_lora_rank)).to(torch.float32).eval()
    randomise(model, gen)

    ckpt = out / f"checkpoint{suffix}"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    model.save_pretrained(ckpt, safe_serialization=True)
    (ckpt / "generation_config.json").unlink(missing_ok=True)  # not part of the model

    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].to(torch.float32).contiguous()
        # Reloading the saved checkpoint must give the same logits (the file is what Terrace reads).
        again = KimiLinearForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        logits2 = again(input_ids=ids, use_cache=False).logits[0].to(torch.float32)
    assert torch.equal(logits, logits2), "save_pretrained / from_pretrained changed the logits"
    expected = out / f"expected{suffix}.safetensors"
    save_file({"input_ids": ids[0].to(torch.int32).contiguous(), "logits": logits}, str(expected),
              metadata={"torch": torch.__version__, "transformers": transformers.__version__})
    print(f"wrote {ckpt} and {expected}: {TOKENS} tokens, vocab {VOCAB}, q_lora_rank {q_lora_rank}, "
          f"max |logit| {logits.abs().max().item():.3f} (torch {torch.__version__}, transformers {transformers.__version__})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=HERE, help="fixture directory (default: next to this script)")
    args = ap.parse_args()
    write(args.out, "", None, 20261201)
    write(args.out, "_qlora", 16, 20261202)


if __name__ == "__main__":
    main()
