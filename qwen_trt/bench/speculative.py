"""``qwen-trt bench --speculative``: speculative decoding's speed as a function of acceptance.

Random weights cannot say what a real draft accepts, so the drafts are controlled: a first run
with speculation off records each prompt's greedy continuation; then, for each target mean
acceptance length ``tau`` (tokens a verify step emits: accepted drafts + the one it samples),
the proposer runs its n-gram lookup as usual (so its cost is spent) and its drafts are replaced
by the target's own continuation, each draft token corrupted with probability ``1 - a``, where
``a`` gives ``tau`` at ``k`` drafts (``tau = (1 - a^(k+1)) / (1 - a)``). The draft count is the
runner's own (auto unless ``num_tokens``), so the adaptive rule is what is measured at
``tau = 1``. Every run checks that the tokens equal the off run's (greedy: exact acceptance).

Per concurrency N (a burst of N prompts of ``prompt_len`` tokens, ``new_tokens`` each): per-stream
decode tok/s p50, aggregate decode tok/s, first token p50, the measured tau, and the ratio to
off in the same process.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass

from qwen_trt.params import SamplingParams


@dataclass(frozen=True)
class SpecBenchConfig:
    shape: str = "qwen3-4b"
    device: str = "auto"
    dtype: str = "auto"
    concurrency: tuple[int, ...] = (1, 8, 32)
    taus: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 4.0)
    prompt_len: int = 512
    new_tokens: int = 256
    num_tokens: int | None = None       # drafts a step (None: the runner's auto rule)
    design_k: int = 4                   # the k at which each tau's corruption is computed
    max_seq_len: int = 4096
    quantization: str = "auto"
    method: str = "ngram"               # ngram | eagle3 (a random draft of the published shape)
    seed: int = 0
    command: str = ""

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency values must be >= 1")
        if not self.taus or min(self.taus) < 1 or max(self.taus) > self.design_k + 1:
            raise ValueError(f"tau values must be from 1 to {self.design_k + 1} (k + 1)")


def write_random_draft(out, target, *, seed: int = 0, draft_vocab: int = 32000):
    """A random EAGLE-3 draft in the SGLang layout with the published Qwen3-4B drafts' shape
    (one decoder layer of the target's width: 32 heads of 128, 8 KV heads, MLP 9728; a
    32,000-token draft vocabulary; ~218 M parameters, ``../shared/reference/speculative.md``)
    for the target shape ``target`` (a FastConfig): what a real draft costs, with no quality."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    from qwen_trt.fast.spec.eagle3 import default_aux_layers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    h, heads, kvh, hd = target.hidden, target.heads, target.kv_heads, target.head_dim
    inter = target.intermediate
    vocab = min(draft_vocab, target.vocab_size)
    g = torch.Generator().manual_seed(seed)
    mat = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    one = lambda: torch.ones(h, dtype=torch.bfloat16)  # noqa: E731
    aux = (default_aux_layers(target.layers) if target.layers >= 6
           else tuple(range(1, min(3, target.layers) + 1)))
    t = {"midlayer.self_attn.q_proj.weight": mat(heads * hd, 2 * h),
         "midlayer.self_attn.k_proj.weight": mat(kvh * hd, 2 * h),
         "midlayer.self_attn.v_proj.weight": mat(kvh * hd, 2 * h),
         "midlayer.self_attn.o_proj.weight": mat(h, heads * hd),
         "midlayer.mlp.gate_proj.weight": mat(inter, h),
         "midlayer.mlp.up_proj.weight": mat(inter, h),
         "midlayer.mlp.down_proj.weight": mat(h, inter),
         "midlayer.input_layernorm.weight": one(), "midlayer.hidden_norm.weight": one(),
         "midlayer.post_attention_layernorm.weight": one(), "norm.weight": one(),
         "fc.weight": mat(h, len(aux) * h), "lm_head.weight": mat(vocab, h),
         }
    ids = torch.randperm(target.vocab_size, generator=g)[:vocab].sort().values
    t["d2t"] = ids - torch.arange(vocab)            # draft id i is target id i + d2t[i]
    t["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool)
    t["t2d"][ids] = True
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kvh,
        "head_dim": hd, "rms_norm_eps": target.rms_eps, "rope_theta": target.rope_theta,
        "vocab_size": target.vocab_size, "draft_vocab_size": vocab,
        "num_hidden_layers": 1, "max_position_embeddings": 262144,
        # SGLang's field names a layer whose output is taken: the one before ours
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]}}))
    return out


def rate_for(tau: float, k: int) -> float:
    """The per-token acceptance ``a`` with ``(1 - a^(k+1)) / (1 - a) = tau`` (bisection)."""
    from qwen_trt.serving.speculation import expected_tokens

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class Oracle:
    """Controlled acceptance (bench only): drafts of ``k`` tokens for every sequence (the n-gram
    lookup has run first, so its cost is spent; its tokens, topped up with the recorded
    continuation), and an acceptance count drawn per verify row, each draft accepted with
    probability ``rate`` until the first that is not. The verify step computes every
    position as usual; only its accept decision is the bench's."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], rate: float,
                 seed: int) -> None:
        self.cont, self.rate = continuations, rate
        self.rng = random.Random(seed)
        self.by_seq: dict[int, list[int]] = {}

    def propose(self, s, generated: int, k: int) -> list[int]:
        c = self.by_seq.get(id(s))
        if c is None:
            c = self.by_seq[id(s)] = self.cont[tuple(s.index.tokens[:s.prompt_len])]
        looked = s.index.propose(k)
        return (looked + c[generated:generated + k] + [1] * k)[:k] if self.rate > 0 else looked

    def has(self, s) -> bool:
        s.index.propose(1)                      # the lookup's cost, as the n-gram path spends it
        return self.rate > 0

    def accept(self, row) -> int:
        a = 0
        while a < row.draft and self.rng.random() < self.rate:
            a += 1
        return a


def agreement(runner, reqs, cont, cfg) -> dict:
    """Greedy with real acceptance, the drafts being the off run's own continuation: how
    far each reply agrees with the off run's (bf16 rounding between a k+1-row verify step and
    a 1-row decode step flips near-tied argmaxes of random weights; after a flip the two
    replies part), and the acceptance until then."""
    from qwen_trt.bench.serving import drive

    class Recorded:             # the off run's continuation as the drafts
        def propose(self, s, generated, k):
            s.index.propose(k)
            return cont[tuple(s.index.tokens[:s.prompt_len])][generated:generated + k]

        def has(self, s):
            return True

    r = runner(Recorded())
    streams, _ = drive(r, reqs)
    same = []
    for (_, p, _), s in zip(reqs, streams):
        ref = cont[tuple(p)]
        n = 0
        while n < min(len(ref), len(s.ids)) and ref[n] == s.ids[n]:
            n += 1
        same.append(n)
    c = r.stats().extra["spec_decode"]
    return {"tokens_equal_prefix_mean": round(sum(same) / len(same), 1),
            "of_tokens": cfg.new_tokens, "identical_replies": sum(x == cfg.new_tokens
                                                               for x in same),
            "replies": len(same), "tau_measured": c["mean_acceptance_length"]}


def run_spec_bench(cfg: SpecBenchConfig, log=print) -> dict:
    import torch

    from qwen_trt.backends.torch_backend import pick_device, pick_dtype
    from qwen_trt.bench.serving import drive, summarize
    from qwen_trt.fast import SHAPES, load_fast_decoder
    from qwen_trt.serving.scheduler import BatchRunner, SchedulerConfig, make_batch_runner
    from qwen_trt.serving.speculation import SpecConfig

    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    fcfg = SHAPES[cfg.shape]
    rng = random.Random(cfg.seed)
    hi = min(fcfg.vocab_size, 150000)
    out: dict = {"command": cfg.command, "config": asdict(cfg),
                 "env": {"torch": torch.__version__, "device": device,
                         "gpu": torch.cuda.get_device_name(device)
                         if device.startswith("cuda") else None}}
    t = time.perf_counter()
    dec = load_fast_decoder(fcfg, weights=None, max_seq_len=cfg.max_seq_len, dtype=dtype, device=device,
                            seed=cfg.seed, warmup=False, quantization=cfg.quantization)
    model = dec.model
    del dec
    max_batch = max(cfg.concurrency)
    kv_tokens = max_batch * (cfg.prompt_len + cfg.new_tokens + 16) + 4096
    k = cfg.num_tokens
    if cfg.method == "eagle3":
        import tempfile

        draft_dir = write_random_draft(tempfile.mkdtemp(prefix="qwen-trt-draft-"), fcfg,
                                       seed=cfg.seed)
        spec = SpecConfig("eagle3", k, draft=str(draft_dir))
    else:
        spec = SpecConfig("ngram", k)
    base = make_batch_runner(model, SchedulerConfig(max_batch=max_batch, speculative=spec),
                             kv_tokens=kv_tokens)
    bm = base.model
    out["load_s"] = round(time.perf_counter() - t, 2)
    log(f"[bench] ready in {out['load_s']} s: buckets {bm.buckets}, logit rows {bm.l_max}"
        if bm.graphs else f"[bench] ready in {out['load_s']} s (no graphs)")

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)

    def runner(oracle=None, on=True) -> BatchRunner:
        return BatchRunner(bm, SchedulerConfig(max_batch=max_batch,
                                               speculative=spec if on else SpecConfig()),
                           oracle=oracle)

    drive(runner(on=False), [(0.0, [rng.randrange(1, hi) for _ in range(cfg.prompt_len)],
                              greedy(8)) for _ in range(max_batch)])       # warm-up
    results: dict = {}
    for n in cfg.concurrency:
        prompts = [[rng.randrange(1, hi) for _ in range(cfg.prompt_len)] for _ in range(n)]
        reqs = [(0.0, p, greedy(cfg.new_tokens)) for p in prompts]
        r0 = runner(on=False)
        streams, _ = drive(r0, reqs)
        off = summarize(streams)
        cont = {tuple(p): s.ids for p, s in zip(prompts, streams)}
        row = {"off": off}
        log(f"[bench] c={n} off: {off['per_stream_tok_s_p50']} tok/s a stream, "
            f"{off['aggregate_decode_tok_s']} aggregate, ttft {off['ttft_ms_p50']} ms")
        for tau in cfg.taus:
            a = 0.0 if tau <= 1.0 else rate_for(tau, cfg.design_k)
            oracle = Oracle(cont, a, cfg.seed)
            r = runner(oracle)
            r.executor.forced_accept = oracle.accept
            streams, _ = drive(r, reqs)
            res = summarize(streams)
            c = r.stats().extra["spec_decode"]
            res["tokens_ok"] = all(len(s.ids) == cfg.new_tokens for s in streams)
            res["acceptance_rate_set"] = round(a, 4)
            res["tau_measured"] = c["mean_acceptance_length"]
            res["verify_steps"] = c["drafts"]
            res["steps"] = r.steps
            for key in ("per_stream_tok_s_p50", "aggregate_decode_tok_s"):
                if res[key] and off[key]:
                    res[key.replace("tok_s", "vs_off")] = round(res[key] / off[key], 3)
            res["ttft_ms_p50_minus_off"] = round(res["ttft_ms_p50"] - off["ttft_ms_p50"], 2)
            row[f"tau={tau:g}"] = res
            log(f"[bench] c={n} tau={tau:g} (measured {res['tau_measured']}): "
                f"{res['per_stream_tok_s_p50']} tok/s a stream "
                f"({res.get('per_stream_vs_off_p50')}x), {res['aggregate_decode_tok_s']} "
                f"aggregate ({res.get('aggregate_decode_vs_off')}x), k drafted {round(c['draft_tokens'] / max(1, c['drafts']), 2)}")
        if n == min(cfg.concurrency):
            row["agreement"] = agreement(runner, reqs, cont, cfg)
            log(f"[bench] c={n} real acceptance on the off run's continuation: "
                f"{row['agreement']}")
        results[str(n)] = row
    out["results"] = results
    return out


def main(argv=None) -> int:
    """``python -m qwen_trt.bench.speculative [--concurrency 1,8,32] [--taus ...] --out F``."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.speculative")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--taus", default="1,1.5,2,3,4")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--num-tokens", type=int, default=None)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--method", default="ngram", choices=("ngram", "eagle3"))
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    cfg = SpecBenchConfig(shape=a.shape, concurrency=tuple(int(x) for x in a.concurrency.split(",")),
                          taus=tuple(float(x) for x in a.taus.split(",")),
                          new_tokens=a.new_tokens, prompt_len=a.prompt_len,
                          num_tokens=a.num_tokens, quantization=a.quantization, method=a.method,
                          command="python -m qwen_trt.bench.speculative " + " ".join(argv or []))
    res = run_spec_bench(cfg)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
