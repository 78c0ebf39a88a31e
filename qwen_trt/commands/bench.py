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
    p.add_argument("--quantization", default=None,
                   help="fast path weight formats to measure beside the checkpoint's own, e.g. "
                        "fp8,int4 (each quantized at load; rows fast:fp8, fast:int4); with "
                        "--concurrency: the one format of that run")
    p.add_argument("--quick", action="store_true", help="tiny workload (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON here (also bench-results/last.json)")
    g = p.add_argument_group("serving (continuous batching): given --concurrency, runs "
                             "qwen_trt.bench.serving instead of the side-by-side paths")
    g.add_argument("--concurrency", default=None, help="streams at once, e.g. 1,8,32")
    g.add_argument("--token-budget", type=int, default=None,
                   help="prefill+decode tokens per step (default 1024)")
    g.add_argument("--max-batch", type=int, default=None,
                   help="sequences in flight (default: the largest concurrency)")
    g.add_argument("--long-prompt", type=int, default=None,
                   help="prompt that arrives while streams decode (default 2048)")
    g.add_argument("--turns", type=int, default=None, help="multi-turn chat turns (default 10)")
    g.add_argument("--turn-tokens", type=int, default=None, help="tokens per turn (default 300)")
    g.add_argument("--no-fifo", action="store_true", help="skip the one-at-a-time baseline")
    g.add_argument("--no-batch1", action="store_true",
                   help="skip today's batch-1 decoder measured first")
    s = p.add_argument_group("speculative decoding: --speculative runs qwen_trt.bench.speculative "
                             "(speed against controlled acceptance lengths, speculation off in "
                             "the same process; random weights of --shape)")
    s.add_argument("--speculative", nargs="?", const="ngram", default=None,
                   choices=("ngram", "eagle3"),
                   help="tok/s a stream and aggregate at --concurrency (default 1,8,32) for "
                        "each --taus, against speculation off: the n-gram proposer, or eagle3 "
                        "(a random draft of the published Qwen3-4B drafts' shape: its cost)"),
    s.add_argument("--taus", default=None, help="mean acceptance lengths (default 1,1.5,2,3,4)")
    s.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens a step (default: the runner's auto rule)")
    h = p.add_argument_group("served path: --http runs qwen_trt.bench.served (the in-process "
                             "runner, then `qwen-trt serve` + the HTTP load generator, one "
                             "closed-loop workload, side by side)")
    h.add_argument("--http", action="store_true",
                   help="compare in process vs over HTTP (needs --model; levels from "
                        "--concurrency, default 1,8,32,64; --max-batch default 32)")
    h.add_argument("--requests", type=int, default=None, help="--http: requests per level "
                   "(default 64)")
    p.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                   help="also draw TTFT and tok/s per path and prompt length (needs the `plot` "
                        "extra); default file: the --out JSON's name with .png, else "
                        "bench-results/last.png")
    p.set_defaults(func=run)


SERVING_QUICK = {"prompt_len": 16, "new_tokens": 8, "long_prompt": 48, "turns": 3,
                 "turn_tokens": 16, "token_budget": 32, "max_seq_len": 256}


def run_serving(args, cuda: bool) -> int:
    from qwen_trt.bench.serving import ServingBenchConfig, run_serving_bench

    quick = args.quick or not cuda
    kw = dict(SERVING_QUICK) if quick else {}
    if args.prompt_lens:
        kw["prompt_len"] = _ints(args.prompt_lens)[0]
    for name in ("new_tokens", "token_budget", "max_batch", "long_prompt", "turns",
                 "turn_tokens"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.max_seq_len != 4096 or not quick:
        kw["max_seq_len"] = args.max_seq_len
    formats = _quantizations(args.quantization)[1:]
    if len(formats) > 1:
        raise QwenTrtError("--quantization with --concurrency takes one format per run "
                           f"(got {','.join(formats)})")
    if formats:
        kw["quantization"] = formats[0]
    try:
        cfg = ServingBenchConfig(
            model=args.model, random_weights=args.random_weights or (not cuda and not args.model),
            shape=args.shape or ("qwen3-4b" if cuda and not quick else "tiny"),
            device=args.device, dtype=args.dtype, concurrency=_ints(args.concurrency),
            fifo=not args.no_fifo, batch1=not args.no_batch1, seed=args.seed,
            command=_command(args), **kw)
    except ValueError as e:
        raise QwenTrtError(str(e)) from e

    save = _saver(args.out, "bench-results/last-serving.json")

    result = run_serving_bench(cfg, log=lambda m: print(m, file=sys.stderr, flush=True),
                               progress=save)
    save(result)
    print(_serving_summary(result))
    return 0


def run_http(args, cuda: bool) -> int:
    from qwen_trt.params import DEFAULT_MAX_BATCH

    from qwen_trt.bench.served import ServedBenchConfig, run_served_bench, summary

    if not args.model:
        raise QwenTrtError("--http needs --model (a checkpoint folder, e.g. one written by "
                           "python -m qwen_trt.bench.shaped_model)")
    quick = args.quick or not cuda
    kw = {"input_words": 40, "output_tokens": 16, "requests": 4} if quick else {}
    if args.new_tokens is not None:
        kw["output_tokens"] = args.new_tokens
    if args.requests is not None:
        kw["requests"] = args.requests
    try:
        cfg = ServedBenchConfig(
            model=args.model, device=args.device, fast="auto" if cuda else "on",
            max_batch=args.max_batch or DEFAULT_MAX_BATCH,
            concurrency=_ints(args.concurrency) if args.concurrency else (1, 8, 32, 64), **kw)
    except ValueError as e:
        raise QwenTrtError(str(e)) from e
    result = run_served_bench(cfg, log=lambda m: print(f"[served] {m}", file=sys.stderr,
                                                       flush=True))
    _saver(args.out, "bench-results/last-served.json")(result)
    print(summary(result))
    return 0 if all(not lv["http"].get("errors") and not lv["in_process"].get("errors")
                    for lv in result["levels"]) else 1


def _serving_summary(result: dict) -> str:
    lines = [f"{result['model']['name']} · {result['env']['dtype']} · "
             f"{result['env']['gpu'] or result['env']['device']} · token budget "
             f"{result['config']['token_budget']}",
             "", "| mode | N | agg decode tok/s | wall out tok/s | per-stream p50 | TTFT p50 ms "
             "| TTFT p95 ms | ITL p95 ms | KV peak GB |", "|" + "---|" * 9]
    for mode in ("burst", "poisson", "fifo"):
        for n, r in result.get(mode, {}).items():
            lines.append(f"| {mode} | {n} | {r['aggregate_decode_tok_s']} | "
                         f"{r['wall_output_tok_s']} | {r['per_stream_tok_s_p50']} | "
                         f"{r['ttft_ms_p50']} | {r['ttft_ms_p95']} | {r['itl_ms_p95']} | "
                         f"{r['kv_peak_GB']} |")
    for n, r in result.get("long_prompt", {}).items():
        lines.append(f"- long prompt ({r['long_prompt']}) at N={n}: its TTFT "
                     f"{r['long_ttft_ms']} ms, running streams' ITL p95 "
                     f"{r['itl_ms_p95_during_prefill']} ms (max {r['itl_ms_max_during_prefill']})")
    mt = result.get("multi_turn", {})
    for k, v in mt.items():
        lines.append(f"- multi-turn {k}: TTFT per turn {v['ttft_ms']} ms "
                     f"(last/first {v['turn_last_over_first']})")
    if "batch1_decoder" in result:
        lines.append(f"- batch-1 decoder: {result['batch1_decoder']}; batched c=1 ratio "
                     f"{result.get('batch1_ratio')}")
    return "\n".join(lines)


def run_speculative(args, cuda: bool) -> int:
    from qwen_trt.bench.speculative import SpecBenchConfig, run_spec_bench

    kw = {}
    if args.concurrency:
        kw["concurrency"] = _ints(args.concurrency)
    if args.taus:
        try:
            kw["taus"] = tuple(float(x) for x in args.taus.split(",") if x.strip())
        except ValueError as e:
            raise QwenTrtError(f"--taus: expected comma-separated numbers, got {args.taus!r}") from e
    if args.prompt_lens:
        kw["prompt_len"] = _ints(args.prompt_lens)[0]
    if args.new_tokens is not None:
        kw["new_tokens"] = args.new_tokens
    if not cuda or args.quick:
        kw.update(prompt_len=kw.get("prompt_len", 32), new_tokens=kw.get("new_tokens", 24),
                  concurrency=kw.get("concurrency", (1, 4)))
    try:
        cfg = SpecBenchConfig(shape=args.shape or ("qwen3-4b" if cuda else "tiny"),
                              device=args.device, dtype=args.dtype,
                              num_tokens=args.num_speculative_tokens, method=args.speculative,
                              quantization=(_split(args.quantization or "") or ["auto"])[0],
                              seed=args.seed, command=_command(args), **kw)
    except ValueError as e:
        raise QwenTrtError(str(e)) from e
    save = _saver(args.out, "bench-results/last.json")
    save(run_spec_bench(cfg, log=lambda m: print(m, file=sys.stderr, flush=True)))
    return 0


def run(args) -> int:
    import torch

    from qwen_trt.bench import BenchConfig, run_bench

    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.http:
        return run_http(args, cuda)
    if args.speculative:
        return run_speculative(args, cuda)
    if args.concurrency:
        return run_serving(args, cuda)
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
                          quantization=_quantizations(args.quantization),
                          command=_command(args), **kw)
    except ValueError as e:
        raise QwenTrtError(str(e)) from e
    save = _saver(args.out, "bench-results/last.json")

    result = run_bench(cfg, log=lambda m: print(m, file=sys.stderr, flush=True), progress=save)
    save(result)
    if args.plot is not None:
        from qwen_trt.bench.plot import default_png, plot_result

        png = args.plot or default_png(args.out or "bench-results/last.json")
        print(f"plot: {plot_result(result, png)}", file=sys.stderr)
    print(_summary(result))
    return 0


def _saver(*dests: str | None):
    """Writes a result as indented JSON to each of ``dests`` given (after each row, and last)."""
    def save(result: dict) -> None:
        text = json.dumps(result, indent=1)
        for dest in filter(None, dests):
            path = Path(dest)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
    return save


def _command(args) -> str:
    """The command line that reproduces this run (options given, in a fixed order)."""
    from qwen_trt.bench import PATHS

    defaults = {"device": "auto", "dtype": "auto", "paths": ",".join(PATHS), "max_seq_len": 4096,
                "seed": 0}
    parts = ["qwen-trt", "bench"]
    for name in ("model", "random_weights", "shape", "device", "dtype", "prompt_lens",
                 "new_tokens", "repeats", "slow_repeats", "paths", "max_seq_len", "quick", "seed",
                 "concurrency", "token_budget", "max_batch", "long_prompt", "turns",
                 "turn_tokens", "no_fifo", "no_batch1", "quantization", "out"):
        value = getattr(args, name)
        if value in (None, False) or defaults.get(name) == value:
            continue
        flag = "--" + name.replace("_", "-")
        parts += [flag] if value is True else [flag, str(value)]
    return shlex.join(parts)


def _quantizations(text: str | None) -> tuple[str, ...]:
    """The fast path's formats: the checkpoint's own first, then each of ``text`` (fp8,int4)."""
    extra = [q for q in _split(text or "") if q not in ("none", "auto")]
    return ("none", *dict.fromkeys(extra))


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
