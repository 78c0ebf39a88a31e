"""Host cost of the n-gram proposer per decode step: ``python -m qwen_trt.bench.spec_lookup``.

``--streams`` requests, each a ``--prompt-len`` prompt of token ids and a scripted reply (both
made of runs copied from earlier in the text between random stretches, so lookups hit about as
often as on input-grounded chats), then ``--steps`` verify steps: every stream's
:meth:`NgramIndex.propose` for ``--k`` drafts, then :meth:`NgramIndex.extend` with what the step
emits (the proposal's prefix that agrees with the script, then the script's next token).
Reports microseconds per step for ALL streams together (propose, extend and both, wall time;
and the thread's CPU time for both, which a busy machine does not inflate), median and p99, the
share of proposals that were not empty and the mean tokens a step emitted, as JSON.
The issue's budget is 50 us per step at 32 streams.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from qwen_trt.fast.spec.ngram import NgramIndex, NgramSettings

VOCAB = 151_936


def _text(rng: random.Random, n: int, before: list[int] = ()) -> list[int]:
    """``n`` tokens following ``before``: runs copied from anywhere earlier (40 %), random
    stretches otherwise."""
    out: list[int] = list(before)
    while len(out) < len(before) + n:
        if out and rng.random() < 0.4:
            start = rng.randrange(len(out))
            out += out[start:start + rng.randrange(4, 24)]
        else:
            out += [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 24))]
    return out[len(before):len(before) + n]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(streams: int, steps: int, prompt_len: int, k: int, settings: NgramSettings,
        seed: int = 0) -> dict:
    rng = random.Random(seed)
    prompts = [_text(rng, prompt_len) for _ in range(streams)]
    scripts = [_text(rng, steps * (k + 1), p) for p in prompts]
    idx = [NgramIndex(settings.n_max, settings.n_min, prompt=p) for p in prompts]
    at = [0] * streams
    prop_us, ext_us, cpu_us, proposed, emitted = [], [], [], 0, 0
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    for _ in range(steps):
        c0 = cpu()
        t0 = clock()
        props = [ix.propose(k) for ix in idx]
        t1 = clock()
        c1 = cpu()
        outs = []
        for s, p in enumerate(props):       # what the verify step would emit (not timed)
            script, i = scripts[s], at[s]
            keep = 0
            while keep < len(p) and p[keep] == script[i + keep]:
                keep += 1
            outs.append(script[i:i + keep + 1])
            at[s] += keep + 1
        c2 = cpu()
        t2 = clock()
        for ix, out in zip(idx, outs):
            ix.extend(out)
        t3 = clock()
        c3 = cpu()
        prop_us.append((t1 - t0) / 1e3)
        ext_us.append((t3 - t2) / 1e3)
        cpu_us.append((c1 - c0 + c3 - c2) / 1e3)
        proposed += sum(1 for p in props if p)
        emitted += sum(len(o) for o in outs)
    both = [a + b for a, b in zip(prop_us, ext_us)]

    def stats(v: list[float]) -> dict:
        return {"median": round(statistics.median(v), 2), "p99": round(_pct(v, 0.99), 2)}

    return {"streams": streams, "steps": steps, "prompt_len": prompt_len, "k": k,
            "n_min": settings.n_min, "n_max": settings.n_max,
            "propose_us": stats(prop_us), "extend_us": stats(ext_us), "step_us": stats(both),
            "step_cpu_us": stats(cpu_us),
            "proposal_rate": round(proposed / (streams * steps), 3),
            "tokens_per_step": round(emitted / (streams * steps), 3),
            "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen_trt.bench.spec_lookup",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4, help="draft tokens proposed per step")
    ap.add_argument("--n-min", type=int, default=NgramSettings.n_min)
    ap.add_argument("--n-max", type=int, default=NgramSettings.n_max)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        settings = NgramSettings(n_max=a.n_max, n_min=a.n_min)
    except ValueError as e:
        ap.error(str(e))
    print(json.dumps(run(a.streams, a.steps, a.prompt_len, a.k, settings, a.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
