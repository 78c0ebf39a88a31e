"""``qwen-trt bench``: TTFT and decode speed of every path, side by side, as JSON + Markdown.

Without CUDA (or with ``--quick``) it runs a small smoke workload; without ``--model`` on a
machine with no GPU it uses random tiny shapes, so it runs anywhere offline.
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from qwen_trt.backends import DTYPES
from qwen_trt.errors import QwenTrtError

QUICK = {"prompt_lens": (16, 48), "new_tokens": 8, "repeats": 2, "slow_repeats": 1}


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise QwenTrtError(f"expected comma-separated integers, got {text!r}") from e


def register(sub) -> None:
    from qwen_trt.bench import PATHS

    p = sub.add_parser("bench", help="benchmark TTFT / decode speed: HF generate vs our paths")
    p.add_argument("--model", default=None, help="checkpoint folder or hub id")
    p.add_argument("--random-weights", action="store_true",
                   help="no checkpoint: random weights with --shape (built on the device)")
    p.add_argument("--shape", choices=("qwen3-4b", "tiny"), default=None,
                   help="with --random-weights (default qwen3-4b on CUDA, tiny on CPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--prompt-lens", default=None, help="default 128,512,2048")
    p.add_argument("--new-tokens", type=int, default=None, help="default 256 (EOS ignored)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per prompt (default 5)")
    p.add_argument("--slow-repeats", type=int, default=None,
                   help="timed runs for the launch-bound hf-eager/torch paths (default 2)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"subset of {','.join(PATHS)}")
    p.add_argument("--max-seq-len", type=int, default=4096, help="fast path KV cache length")
    p.add_argument("--quick", action="store_true", help="tiny workload (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON here (also bench-results/last.json)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from qwen_trt.bench import BenchConfig, run_bench

    cuda = torch.cuda.is_available() and args.device != "cpu"
    quick = args.quick or not cuda
    random_weights = args.random_weights or (not cuda and args.model is None)
    shape = args.shape or ("qwen3-4b" if cuda and not quick else "tiny")
    kw = dict(QUICK) if quick else {}
    if args.prompt_lens:
        kw["prompt_lens"] = _ints(args.prompt_lens)
    for name in ("new_tokens", "repeats", "slow_repeats"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    try:
        cfg = BenchConfig(model=args.model, random_weights=random_weights, shape=shape,
                          device=args.device, dtype=args.dtype, paths=tuple(_split(args.paths)),
                          max_seq_len=args.max_seq_len, seed=args.seed,
                          command=_command(args), **kw)
    except ValueError as e:
        raise QwenTrtError(str(e)) from e
    def save(result: dict) -> None:
        text = json.dumps(result, indent=1)
        for dest in filter(None, (args.out, "bench-results/last.json")):
            path = Path(dest)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")

    result = run_bench(cfg, log=lambda m: print(m, file=sys.stderr, flush=True), progress=save)
    save(result)
    print(_summary(result))
    return 0


def _command(args) -> str:
    """The command line that reproduces this run (options given, in a fixed order)."""
    from qwen_trt.bench import PATHS

    defaults = {"device": "auto", "dtype": "auto", "paths": ",".join(PATHS), "max_seq_len": 4096,
                "seed": 0}
    parts = ["qwen-trt", "bench"]
    for name in ("model", "random_weights", "shape", "device", "dtype", "prompt_lens",
                 "new_tokens", "repeats", "slow_repeats", "paths", "max_seq_len", "quick", "seed",
                 "out"):
        value = getattr(args, name)
        if value in (None, False) or defaults.get(name) == value:
            continue
        flag = "--" + name.replace("_", "-")
        parts += [flag] if value is True else [flag, str(value)]
    return shlex.join(parts)


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _summary(result: dict) -> str:
    from qwen_trt.bench import Row, markdown

    env, model = result["env"], result["model"]
    rows = [Row(**r) for r in result["rows"]]
    head = (f"{model['name']} · {model['params'] / 1e9:.2f} B params · {env['dtype']} · "
            f"{env['gpu'] or env['device']} · torch {env['torch']} · transformers "
            f"{env['transformers']}")
    if env["copy_TBps"]:
        head += (f"\ncopy bandwidth {env['copy_TBps']:.2f} TB/s → roofline "
                 f"{model['roofline_tok_s']:.0f} tok/s")
    paths = "\n".join(f"- {k}: {v['status']}" + (f" ({', '.join(f'{a}={b}' for a, b in v.items() if a != 'status')})"
                                               if len(v) > 1 else "")
                      for k, v in result["paths"].items())
    return f"{head}\n\n{markdown(rows)}\n\n{paths}"
