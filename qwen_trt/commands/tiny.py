"""``qwen-trt tiny-model DIR``: write the offline tiny Qwen3 checkpoint; ``qwen-trt tiny-draft
DIR --target MODEL_DIR``: a tiny random EAGLE-3 draft for it."""
from __future__ import annotations

import time

from qwen_trt.model.tiny import TinyShape


def register(sub) -> None:
    p = sub.add_parser("tiny-model", help="write a tiny random Qwen3 checkpoint + tokenizer (offline)")
    p.add_argument("dir", help="output folder")
    d = TinyShape()
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocab before specials")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true",
                   help="write into a folder that is not empty (overwrites what is there)")
    p.set_defaults(func=run)
    register_draft(sub)


def run(args) -> int:
    from qwen_trt.model.tiny import write_tiny_model

    shape = TinyShape(layers=args.layers, hidden=args.hidden, heads=args.heads,
                      kv_heads=args.kv_heads, head_dim=args.head_dim,
                      intermediate=args.intermediate, vocab_size=args.vocab_size)
    t = time.perf_counter()
    out = write_tiny_model(args.dir, shape, seed=args.seed, force=args.force)
    print(f"wrote tiny Qwen3 checkpoint to {out} in {time.perf_counter() - t:.1f}s")
    return 0


def register_draft(sub) -> None:
    from qwen_trt.model.tiny_draft import DRAFT_LAYOUTS

    p = sub.add_parser("tiny-draft", help="write a tiny random EAGLE-3 draft for a (tiny) Qwen3 "
                                          "checkpoint (offline)")
    p.add_argument("dir", help="output folder")
    p.add_argument("--target", required=True, help="the checkpoint folder the draft is for")
    p.add_argument("--layout", choices=DRAFT_LAYOUTS, default="sglang",
                   help="sglang: LlamaForCausalLMEagle3, midlayer.*; speculators: vLLM's "
                        "Eagle3Speculator, layers.0.*")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft vocabulary size (default min(256, target vocab / 2))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true",
                   help="write into a folder that is not empty (overwrites what is there)")
    p.set_defaults(func=run_draft)


def run_draft(args) -> int:
    from qwen_trt.model.tiny_draft import write_tiny_draft

    out = write_tiny_draft(args.dir, args.target, args.layout, seed=args.seed,
                           draft_vocab=args.draft_vocab, force=args.force)
    print(f"wrote tiny EAGLE-3 draft ({args.layout} layout) to {out}")
    return 0
