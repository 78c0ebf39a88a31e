"""A small load generator for any OpenAI-compatible server: N concurrent streaming chats.

    python -m qwen_trt.bench.http_bench --url http://127.0.0.1:8000/v1 --concurrency 1,8,32 \\
        --requests 64 --input-words 400 --output-tokens 256 --out bench.json

Per concurrency level: TTFT and inter-token latency percentiles (client side, so the HTTP layer
is included), per-request decode rate, aggregate output tokens/s and requests/s, and errors.
Output length is forced with ``ignore_eos`` (qwen-trt serve, vLLM, SGLang accept it); token
counts come from the server's usage (``stream_options.include_usage``). No dependency beyond
httpx, so it runs wherever the project runs (the device too).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field

from qwen_trt.bench.measure import percentile


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float | None = None         # None: no text at all (e.g. only special tokens)
    total_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    duration_s: float
    request_throughput: float           # finished requests / s
    output_token_throughput: float      # all output tokens / s
    ttft_ms_p50: float
    ttft_ms_p90: float
    ttft_ms_p99: float
    itl_ms_p50: float                   # (last - first content) / (tokens - 1), per request
    itl_ms_p90: float
    decode_tok_s_per_user_p50: float
    prompt_tokens_mean: float
    output_tokens_mean: float
    first_error: str = ""

    def to_json(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def prompt_text(i: int, words: int) -> str:
    """A distinct prompt per request (its number first, so no prefix is shared)."""
    return f"Request {i}. " + " ".join(f"word{(i * 7 + k) % 997}" for k in range(words))


async def one_request(client, model: str, i: int, args) -> RequestResult:
    import httpx

    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt_text(i, args.input_words)}],
            "max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = None
    usage = None
    res = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"{r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except ValueError:
                    res.error = f"an SSE event that is not JSON: {data[:80]!r}"
                    return res
                if "error" in obj:
                    res.error = str(obj["error"])[:200]
                    return res
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            res.chunk_gaps_s.append(now - last)
                        last = now
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.total_s = time.perf_counter() - t0
    if first is None and usage is None:
        res.error = "no content and no usage"
        return res
    res.ok = True
    res.output_tokens = (usage or {}).get("completion_tokens") or len(res.chunk_gaps_s) + 1
    res.prompt_tokens = (usage or {}).get("prompt_tokens") or 0
    if first is not None:
        res.ttft_s = first - t0
        res.chunk_gaps_s = [last - first]  # keep only the span: ITL = span / (tokens - 1)
    return res


async def run_level(url: str, model: str, concurrency: int, args) -> LevelResult:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout, connect=10)) as client:
        for w in range(args.warmup):
            await one_request(client, model, 10_000_000 + w, args)
        todo = iter(range(args.requests))
        results: list[RequestResult] = []

        async def worker() -> None:
            for i in todo:
                results.append(await one_request(client, model, concurrency * 100_000 + i, args))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        dur = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    timed = [r for r in ok if r.ttft_s is not None]
    ttft = [r.ttft_s * 1e3 for r in timed]
    itl = [r.chunk_gaps_s[0] / (r.output_tokens - 1) * 1e3 for r in timed
           if r.output_tokens > 1 and r.chunk_gaps_s]
    rate = [1e3 / x for x in itl if x > 0]
    nan = float("nan")

    def pct(xs, q):
        return percentile(xs, q) if xs else nan

    errs = [r.error for r in results if not r.ok]
    return LevelResult(
        concurrency=concurrency, requests=len(results), errors=len(errs), duration_s=dur,
        request_throughput=len(ok) / dur, output_token_throughput=sum(r.output_tokens for r in ok) / dur,
        ttft_ms_p50=pct(ttft, 50), ttft_ms_p90=pct(ttft, 90), ttft_ms_p99=pct(ttft, 99),
        itl_ms_p50=pct(itl, 50), itl_ms_p90=pct(itl, 90), decode_tok_s_per_user_p50=pct(rate, 50),
        prompt_tokens_mean=sum(r.prompt_tokens for r in ok) / max(len(ok), 1),
        output_tokens_mean=sum(r.output_tokens for r in ok) / max(len(ok), 1),
        first_error=errs[0] if errs else "")


def tok_free_port() -> int:
    """A free loopback port (for benches that start their own server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def discover_model(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{url}/models", headers=headers, timeout=30).json()["data"][0]["id"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.http_bench", description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="API root, ending in /v1")
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=32, help="requests per level")
    p.add_argument("--input-words", type=int, default=100, help="synthetic prompt words")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2, help="requests before each level")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--label", default="", help="free text stored in the JSON")
    p.add_argument("--out", default=None, help="write the JSON here (also printed)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    url = args.url.rstrip("/")
    url = url if url.endswith("/v1") else url + "/v1"
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
        assert levels and min(levels) >= 1
    except (ValueError, AssertionError):
        print(f"http_bench: error: --concurrency must be positive integers, got {args.concurrency!r}",
              file=sys.stderr)
        return 2
    model = args.model or discover_model(url, args.api_key)
    out = {"tool": "qwen_trt.bench.http_bench", "url": url, "model": model, "label": args.label,
           "input_words": args.input_words, "output_tokens": args.output_tokens,
           "requests_per_level": args.requests, "levels": []}
    for c in levels:
        res = asyncio.run(run_level(url, model, c, args))
        out["levels"].append(res.to_json())
        print(f"c={c:3d}  {res.output_token_throughput:8.1f} out tok/s  {res.request_throughput:6.2f} "
              f"req/s  TTFT p50 {res.ttft_ms_p50:7.1f} ms p99 {res.ttft_ms_p99:7.1f} ms  "
              f"ITL p50 {res.itl_ms_p50:6.2f} ms  errors {res.errors}", file=sys.stderr)
    text = json.dumps(out, indent=2)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)
    return 0 if all(lv["errors"] == 0 for lv in out["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
