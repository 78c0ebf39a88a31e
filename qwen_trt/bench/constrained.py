"""What constrained decoding and logprobs cost on the fast path (against the speed targets in docs/benchmarks.md):

    python -m qwen_trt.bench.constrained --model DIR [--streams 8] [--new-tokens 256] --out F.json

``DIR``: a checkpoint with its tokenizer, e.g. the shaped random-weight one
(``python -m qwen_trt.bench.shaped_model DIR``: Qwen3-4B shapes, a 151,936-wide mask). All
requests are greedy, so the random weights pick text tokens. Workloads, each through the
batched runner (driven directly, like the serving bench) unless noted:

* ``batch1_plain`` / ``batch1_json_schema``: one request on the batch-1 decoder (its CUDA
  graphs; the constrained one runs step by step with its ``+mask`` graph);
* ``runner1_plain`` / ``runner1_json_schema``: one request through the runner;
* ``streams_plain``: ``--streams`` plain requests at once; ``streams_one_constrained``: the
  same with one of them constrained (the others' per-stream tok/s is the figure);
* ``streams_logprobs``: the same plain requests, each with 5 top logprobs.

The schema asks for one long string (``{"text": ...}``), so a constrained reply runs to about
``--new-tokens`` (the constraint closes it near the budget). Ratios in ``summary``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from qwen_trt.bench.serving import drive, summarize
from qwen_trt.params import Grammar, SamplingParams

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def _params(n: int, *, grammar: bool = False, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=not grammar,
                          logprobs=logprobs,
                          grammar=Grammar("json_schema", json.dumps(SCHEMA)) if grammar else None)


def _decode_tok_s(stamps: list[float]) -> float | None:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None


def _batch1(backend, prompt: list[int], params: SamplingParams) -> dict:
    stamps = []
    for _ in backend.stream(prompt, params):
        stamps.append(time.perf_counter())
    return {"tokens": len(stamps), "decode_tok_s": round(_decode_tok_s(stamps) or 0, 1)}


def run(model: str, *, streams: int = 8, new_tokens: int = 256, prompt_len: int = 512,
        device: str = "auto", log=print) -> dict:
    from qwen_trt.backends.fast_backend import FastBackend
    from qwen_trt.serving.scheduler import SchedulerConfig, batch_runner_for

    backend = FastBackend.load(model, device=device)
    tok = backend.tokenizer
    words = tok.encode("The quick brown fox jumps over the lazy dog. ", add_special_tokens=False)
    prompt = (words * (prompt_len // len(words) + 1))[:prompt_len]
    out: dict = {"model": model, "streams": streams, "new_tokens": new_tokens,
                 "prompt_len": prompt_len, "device": backend.info.device}
    for name, params in (("batch1_plain", _params(new_tokens)),
                         ("batch1_json_schema", _params(new_tokens, grammar=True))):
        _batch1(backend, prompt, params)                      # warm: lazy graph captures
        out[name] = _batch1(backend, prompt, params)
        log(f"{name}: {out[name]}")
    runner = batch_runner_for(backend, SchedulerConfig(max_batch=max(streams, 1)))

    def workload(name: str, plist: list[SamplingParams]) -> list:
        reqs = [(0.0, list(prompt[:-1]) + [prompt[-1] + i % 3], p) for i, p in enumerate(plist)]
        drive(runner, reqs)                                   # warm
        got, _ = drive(runner, reqs)
        out[name] = summarize(got)
        out[name]["per_stream_tok_s"] = [round(_decode_tok_s(s.stamps) or 0, 1) for s in got]
        log(f"{name}: {out[name]['aggregate_decode_tok_s']} tok/s aggregate")
        return got

    workload("runner1_plain", [_params(new_tokens)])
    workload("runner1_json_schema", [_params(new_tokens, grammar=True)])
    workload("streams_plain", [_params(new_tokens)] * streams)
    workload("streams_one_constrained",
             [_params(new_tokens, grammar=True)] + [_params(new_tokens)] * (streams - 1))
    workload("streams_logprobs", [_params(new_tokens, logprobs=5)] * streams)

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    others = out["streams_one_constrained"]["per_stream_tok_s"][1:]
    plain = out["streams_plain"]["per_stream_tok_s"][1:]
    out["summary"] = {
        "batch1_json_schema_vs_plain": ratio(out["batch1_json_schema"]["decode_tok_s"],
                                             out["batch1_plain"]["decode_tok_s"]),
        "runner1_json_schema_vs_plain": ratio(
            out["runner1_json_schema"]["per_stream_tok_s"][0],
            out["runner1_plain"]["per_stream_tok_s"][0]),
        "others_with_one_constrained_vs_plain": ratio(sum(others), sum(plain)),
        "logprobs_vs_plain_aggregate": ratio(
            out["streams_logprobs"]["aggregate_decode_tok_s"],
            out["streams_plain"]["aggregate_decode_tok_s"]),
    }
    log(f"summary: {out['summary']}")
    backend.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = run(a.model, streams=a.streams, new_tokens=a.new_tokens, prompt_len=a.prompt_len,
              device=a.device, log=lambda line: print(line, file=sys.stderr))
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
