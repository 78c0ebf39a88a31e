"""What the HTTP layer costs: the same requests through the engine service in process, then
through ``qwen-trt serve``'s app over loopback (streaming, the official chunk format), one at a
time, alternating so both see the same machine state.

    python -m qwen_trt.bench.http_overhead --model DIR [--device cpu] [--requests 20] --out x.json

In process, TTFT is submit -> first text (token ids in, chat template done beforehand); over
HTTP it is request sent -> first content chunk, so the difference is the API's own cost: JSON
parsing and checks, the chat template and tokenization, the event bridge, SSE framing and the
loopback socket. Timings are medians; ``hops_us`` splits the server's share per hop
(:mod:`qwen_trt.api.hops`). JSON out.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from qwen_trt.bench.measure import percentile


def _service_ttft(service, ids, params) -> tuple[float, float]:
    from qwen_trt.serving.events import Delta, Finished

    t0 = time.perf_counter()
    first = None
    for ev in service.submit(ids, params).events(poll_s=0.01):
        if isinstance(ev, Delta) and first is None:
            first = time.perf_counter()
        if isinstance(ev, Finished):
            break
    return (first or time.perf_counter()) - t0, time.perf_counter() - t0


def _http_ttft(client, body) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", "/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter()
    return (first or time.perf_counter()) - t0, time.perf_counter() - t0


def main(argv=None) -> int:
    import httpx
    import uvicorn

    from qwen_trt.api.hops import HopClock
    from qwen_trt.api.prompt import encode_messages
    from qwen_trt.api.server import ServerSettings, create_app
    from qwen_trt.backends import BackendConfig
    from qwen_trt.bench.http_bench import prompt_text, tok_free_port
    from qwen_trt.params import SamplingParams
    from qwen_trt.serving.service import start_service

    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.http_overhead")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--input-words", type=int, default=100)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    service = start_service(BackendConfig(model=args.model, device=args.device))
    port = tok_free_port()
    hops = HopClock()
    server = uvicorn.Server(uvicorn.Config(create_app(service, ServerSettings(port=port),
                                                      model_name="m", hops=hops),
                                           host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    params = SamplingParams(max_new_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    rows = {"in_process": [], "http": []}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=600) as client:
        for i in range(args.requests + 2):       # the first two are warm-up
            msgs = [{"role": "user", "content": prompt_text(i, args.input_words)}]
            ids = encode_messages(service.tokenizer, msgs)
            a = _service_ttft(service, ids, params)
            b = _http_ttft(client, {"messages": msgs, "stream": True, "temperature": 0,
                                    "max_tokens": args.output_tokens, "ignore_eos": True})
            if i >= 2:
                rows["in_process"].append(a)
                rows["http"].append(b)
    server.should_exit = True
    service.close()

    def med(key, k):
        return round(percentile([r[k] * 1e3 for r in rows[key]], 50), 3)

    res = {"tool": "qwen_trt.bench.http_overhead", "model": args.model, "device": args.device,
           "requests": args.requests, "prompt_tokens": len(ids), "output_tokens": args.output_tokens,
           "in_process_ttft_ms_p50": med("in_process", 0), "http_ttft_ms_p50": med("http", 0),
           "in_process_total_ms_p50": med("in_process", 1), "http_total_ms_p50": med("http", 1)}
    res["http_ttft_overhead_ms"] = round(res["http_ttft_ms_p50"] - res["in_process_ttft_ms_p50"], 3)
    res["http_total_overhead_ms"] = round(res["http_total_ms_p50"] - res["in_process_total_ms_p50"], 3)
    res["http_per_token_overhead_ms"] = round(
        (res["http_total_overhead_ms"] - res["http_ttft_overhead_ms"])
        / max(1, args.output_tokens - 1), 3)
    res["hops_us"] = hops.summary()       # inside the server: see qwen_trt.api.hops
    text = json.dumps(res, indent=2)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
