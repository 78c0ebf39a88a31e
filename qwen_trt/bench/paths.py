"""The contenders, each as ``run(prompt_ids, new_tokens) -> RunTiming``.

* ``hf-eager``: ``model.generate`` (sdpa attention, dynamic cache), the project baseline;
* ``hf-static``: ``generate(cache_implementation="static")`` (transformers auto-compiles it);
* ``torch``: our torch backend's reference path (HF model, our decode loop);
* ``fast``: our compact model (:mod:`qwen_trt.fast`);
* ``trtllm``: the TensorRT-LLM backend, when an engine and the library are present.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from qwen_trt.bench.measure import RunTiming, time_stream, timing_from_stamps
from qwen_trt.params import SamplingParams

PATHS = ("hf-eager", "hf-static", "torch", "fast", "trtllm")
Runner = Callable[[Sequence[int], int], RunTiming]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def hf_runner(model, *, static: bool) -> Runner:
    """``model.generate``; a streamer stamps each token (HF moves each one to the host)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class _Streamer(BaseStreamer):
        def __init__(self) -> None:
            self.seen_prompt = False
            self.stamps: list[float] = []
            self.ids: list[int] = []

        def put(self, value) -> None:
            if not self.seen_prompt:       # the first put is the prompt
                self.seen_prompt = True
                return
            for t in value.reshape(-1).tolist():
                self.stamps.append(time.perf_counter())
                self.ids.append(int(t))

        def end(self) -> None:
            pass

    def run(prompt_ids: Sequence[int], n: int) -> RunTiming:
        kw = {"cache_implementation": "static"} if static else {}
        streamer = _Streamer()
        t0 = time.perf_counter()
        with torch.inference_mode():
            ids = torch.tensor([list(prompt_ids)], device=model.device)
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           do_sample=False, streamer=streamer, **kw)
        return timing_from_stamps(t0, streamer.stamps, streamer.ids)
    return run


def backend_runner(backend) -> Runner:
    return lambda prompt_ids, n: time_stream(lambda: backend.stream(prompt_ids, greedy(n)))


def engine_runner(engine) -> Runner:
    return lambda prompt_ids, n: time_stream(lambda: engine.generate(prompt_ids, greedy(n)))


def build_hf_model(cfg, *, model_dir: str | Path | None, dtype, device):
    """HF ``Qwen3ForCausalLM``: from ``model_dir``, or random weights built on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if model_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    else:
        hf_cfg = Qwen3Config(**{k: v for k, v in cfg.to_hf().items()
                                if k not in ("model_type", "architectures")})
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = Qwen3ForCausalLM(hf_cfg)
        finally:
            torch.set_default_dtype(prev)
    model.eval()
    # Benchmarks generate exactly the asked number of tokens (no EOS stop, no EOS suppression).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
