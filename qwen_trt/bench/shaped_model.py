"""A random-weight checkpoint with a real model's shapes, for timing the served path on a GPU
without a download:

    python -m qwen_trt.bench.shaped_model DIR [--shape qwen3-4b] [--seed 0]

The folder loads like the hub checkpoint (``config.json``, one ``model.safetensors`` in
bfloat16, the offline tiny model's tokenizer and chat template), so ``qwen-trt serve --model
DIR`` reads, checks and warms up what it would for Qwen3-4B-Instruct-2507: the same layer
shapes, the same 151,936-row tied embedding (the LM head reads as many bytes per step) and the
same context limit (262,144 positions, so the served default of 32,768 applies). Weights are
normal(0, 0.02) like ``qwen_trt.fast.model.weights.init_random``; norms are 1.

With ``--vocab-gguf`` it carries Qwen's real 151,643-token BPE (:mod:`qwen_trt.bench.qwen_vocab`),
so encoding and detokenizing cost what they cost with the hub tokenizer; the embedding rows of
its added (control) tokens are zero, so greedy decoding only picks text. Without it the
tokenizer knows only a few hundred ids. The embedding rows past them are zero, so with the
tied LM head their logits are 0 while the known tokens' logits are spread around 0: greedy
decoding (what the benchmarks use, lengths forced with ``ignore_eos``) only ever picks ids the
tokenizer can turn into text. Sampling at a temperature would pick the padding and stream
empty text: use greedy requests with this model. The text is noise by design.

Writing 8 GB takes seconds on a GPU machine: the numbers are drawn on the GPU when there is one.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

STD = 0.02


def _tensors(cfg):
    """(HF name, shape, is_norm) of every weight of a Qwen3 checkpoint with ``cfg``'s shapes."""
    h, hd = cfg.hidden, cfg.head_dim
    yield "model.embed_tokens.weight", (cfg.vocab_size, h), False
    yield "model.norm.weight", (h,), True
    if not cfg.tie_embeddings:
        yield "lm_head.weight", (cfg.vocab_size, h), False
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,), True
        yield p + "post_attention_layernorm.weight", (h,), True
        yield p + "self_attn.q_proj.weight", (cfg.q_size, h), False
        yield p + "self_attn.k_proj.weight", (cfg.kv_size, h), False
        yield p + "self_attn.v_proj.weight", (cfg.kv_size, h), False
        yield p + "self_attn.o_proj.weight", (h, cfg.q_size), False
        yield p + "self_attn.q_norm.weight", (hd,), True
        yield p + "self_attn.k_norm.weight", (hd,), True
        yield p + "mlp.gate_proj.weight", (cfg.intermediate, h), False
        yield p + "mlp.up_proj.weight", (cfg.intermediate, h), False
        yield p + "mlp.down_proj.weight", (h, cfg.intermediate), False


def write_shaped_model(out_dir: str | Path, shape="qwen3-4b", *, seed: int = 0,
                       device: str = "auto", force: bool = False,
                       vocab_gguf: str | Path | None = None,
                       tokenizer_from: str | Path | None = None) -> Path:
    """Write the checkpoint into ``out_dir`` (new or empty unless ``force``); ``shape`` is a
    name of ``qwen_trt.fast.SHAPES`` or a :class:`~qwen_trt.fast.FastConfig`. ``vocab_gguf``:
    llama.cpp's ``ggml-vocab-qwen2.gguf``, for Qwen's real tokenizer
    (:mod:`qwen_trt.bench.qwen_vocab`) instead of the tiny model's; ``tokenizer_from``: a folder
    that ``python -m qwen_trt.bench.qwen_vocab`` wrote, the same tokenizer without the GGUF
    conversion (a machine without the ``gguf`` package). Returns the folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from qwen_trt.fast import SHAPES
    from qwen_trt.model.tiny import write_tiny_model

    cfg = SHAPES[shape] if isinstance(shape, str) else shape
    out = write_tiny_model(out_dir, seed=seed, force=force)    # tokenizer, template, config
    for f in out.glob("*.safetensors"):
        f.unlink()
    if vocab_gguf is not None:
        from qwen_trt.bench.qwen_vocab import BPE_TOKENS, write_tokenizer

        write_tokenizer(vocab_gguf, out)
    elif tokenizer_from is not None:
        from qwen_trt.bench.qwen_vocab import BPE_TOKENS, copy_tokenizer

        copy_tokenizer(tokenizer_from, out)
        vocab_gguf = tokenizer_from          # the same ids from here on
    known = len(AutoTokenizer.from_pretrained(out))
    text_ids = BPE_TOKENS if vocab_gguf is not None else known   # greedy never picks a control
    if known > cfg.vocab_size:
        cfg = replace(cfg, vocab_size=known)
    hf = json.loads((out / "config.json").read_text())
    hf.update(cfg.to_hf())
    if "layer_types" in hf:           # one entry per layer (transformers 5.x checks the length)
        hf["layer_types"] = ["full_attention"] * cfg.layers
    hf["max_window_layers"] = cfg.layers
    hf["dtype"] = hf["torch_dtype"] = "bfloat16"   # transformers 5.x / 4.57 names
    if vocab_gguf is not None:        # the tiny ids of <|endoftext|> / <|im_end|> -> Qwen's
        gen_path = out / "generation_config.json"
        for d, path in ((hf, None), (json.loads(gen_path.read_text()) if gen_path.exists()
                                     else None, gen_path)):
            if d is None:
                continue
            d.update({"bos_token_id": BPE_TOKENS, "pad_token_id": BPE_TOKENS,
                      "eos_token_id": ([BPE_TOKENS + 2, BPE_TOKENS]
                                       if isinstance(d.get("eos_token_id"), list)
                                       else BPE_TOKENS + 2)})
            if path is not None:
                path.write_text(json.dumps(d, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    state = {}
    for name, shp, norm in _tensors(cfg):
        if norm:
            t = torch.ones(shp, dtype=torch.bfloat16)
        else:
            t = torch.empty(shp, dtype=torch.bfloat16, device=dev).normal_(0.0, STD, generator=g)
            if name == "model.embed_tokens.weight" or name == "lm_head.weight":
                t[text_ids:] = 0       # ids that are not text: never the greedy pick
            t = t.cpu()
        state[name] = t
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "README.md").write_text(
        f"Random-weight checkpoint with {cfg.n_params:,} parameters in the shapes of "
        f"{shape if isinstance(shape, str) else 'a custom config'}, written by "
        f"qwen_trt.bench.shaped_model for timing only; its text is noise.\n")
    return out


def main(argv: list[str] | None = None) -> int:
    from qwen_trt.fast import SHAPES

    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.shaped_model",
                                description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="where the numbers are drawn (auto: GPU)")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    p.add_argument("--vocab-gguf", default=None,
                   help="llama.cpp's models/ggml-vocab-qwen2.gguf: Qwen's real 151,643-token "
                        "tokenizer instead of the tiny one (qwen_trt.bench.qwen_vocab)")
    p.add_argument("--tokenizer-from", default=None,
                   help="a folder written by `python -m qwen_trt.bench.qwen_vocab`: the same "
                        "real tokenizer, copied (no gguf package needed)")
    args = p.parse_args(argv)
    t = time.perf_counter()
    out = write_shaped_model(args.dir, args.shape, seed=args.seed, device=args.device,
                             force=args.force, vocab_gguf=args.vocab_gguf,
                             tokenizer_from=args.tokenizer_from)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e9
    print(f"wrote {out} ({args.shape} shapes, {size:.2f} GB) in {time.perf_counter() - t:.1f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
