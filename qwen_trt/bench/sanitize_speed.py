"""CPU cost of the chat UI's Markdown-to-safe-HTML rendering (``make bench-sanitize``).

The app sanitises every streamed chunk's open tail (:class:`qwen_trt.ui.stream.StreamView`) and
each whole reply once (the final draw; history redraws are cached). This feeds a reply of
ordinary Markdown (headings, lists, emphasis, links, code spans, a fenced block, a table) to a
StreamView in chunks the size of a few tokens and times each chunk, then times the whole reply
uncached. ``python -m qwen_trt.bench.sanitize_speed [--chars N] [--chunk N] [--out FILE]``;
JSON to stdout and ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from qwen_trt.ui import text as ui_text
from qwen_trt.ui.stream import StreamView

PART = (
    "## Step {n}: what to do\n\n"
    "Here is a **short answer** with a list, a [link](https://example.com/docs?x=1&y=2) and "
    "`inline code`:\n\n"
    "- the first point, with `a < b` and $5;\n"
    "- the second point, a little longer than the first one, to wrap a line;\n"
    "  1. a nested step\n  2. another one\n\n"
    "```python\ndef f(x):\n    return x * 2  # a comment with `backticks`\n```\n\n"
    "| name | value |\n|---|---:|\n| alpha | 1 |\n| beta | 22 |\n\n"
    "> A quoted remark, _with emphasis_, ends the part. See https://example.org/page.\n\n"
)


def reply(chars: int) -> str:
    out, n = [], 1
    while sum(map(len, out)) < chars:
        out.append(PART.format(n=n))
        n += 1
    return "".join(out)[:chars]


def _ms(values: list[float]) -> dict:
    values = sorted(values)
    return {"median": round(statistics.median(values), 3),
            "p99": round(values[min(len(values) - 1, int(len(values) * 0.99))], 3),
            "max": round(values[-1], 3)}


def run(chars: int = 4000, chunk: int = 12, repeats: int = 5) -> dict:
    text = reply(chars)
    full = getattr(ui_text.markdown_html, "__wrapped__", ui_text.markdown_html)
    per_chunk, per_reply, whole = [], [], []
    clear = getattr(ui_text.markdown_html, "cache_clear", lambda: None)
    for _ in range(repeats):
        clear()                       # each reply is new text: no cache hits from the last
        view = StreamView()
        t_reply = time.perf_counter()
        for i in range(0, len(text), chunk):
            t0 = time.perf_counter()
            view.add(text[i:i + chunk])
            per_chunk.append((time.perf_counter() - t0) * 1000)
        per_reply.append((time.perf_counter() - t_reply) * 1000)
        clear()
        t0 = time.perf_counter()
        full(text)
        whole.append((time.perf_counter() - t0) * 1000)
    return {"command": " ".join(["python -m qwen_trt.bench.sanitize_speed", *sys.argv[1:]]),
            "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
            "reply_chars": len(text), "chunk_chars": chunk, "repeats": repeats,
            "chunks_per_reply": -(-len(text) // chunk),
            "chunk_ms": _ms(per_chunk), "stream_reply_total_ms": _ms(per_reply),
            "whole_reply_ms": _ms(whole)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chars", type=int, default=4000, help="reply length in characters")
    p.add_argument("--chunk", type=int, default=12, help="characters per streamed chunk")
    p.add_argument("--repeats", type=int, default=5, help="replies streamed")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.chars < 1 or args.chunk < 1 or args.repeats < 1:
        p.error("--chars, --chunk and --repeats must be at least 1")
    result = run(args.chars, args.chunk, args.repeats)
    doc = json.dumps(result, indent=1)
    print(doc)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(doc + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
