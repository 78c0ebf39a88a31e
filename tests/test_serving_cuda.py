"""On a GPU: the app's engine service over the CUDA fast path. The backend (compiled, CUDA
graphs) is loaded in this thread and serves requests from the service's worker thread, the way
the Streamlit app runs it; replies must equal the same greedy requests run directly."""
from __future__ import annotations

import threading

import pytest

from qwen_trt.backends import BackendConfig
from qwen_trt.serving.session import ChatSession
from qwen_trt.params import SamplingParams
from qwen_trt.serving.service import start_service

pytestmark = pytest.mark.cuda


def test_fast_backend_serves_from_the_worker_thread(tiny_model_dir):
    service = start_service(BackendConfig(model=str(tiny_model_dir), device="cuda"))
    try:
        backend = service.backend
        assert backend.info.name == "torch-fast"
        greedy = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)
        prompts = [ChatSession(service.tokenizer).prepare(
            t, max_input_len=1000, max_seq_len=2048, max_new_tokens=48).ids
            for t in ("你好 🚀", "tell me about GPUs", "def f(x):")]
        direct = [list(backend.stream(p, greedy)) for p in prompts]   # this thread
        results: dict[int, list[int]] = {}

        def ask(i):
            results[i] = service.submit(prompts[i], greedy).result(timeout=120).token_ids

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert [results[i] for i in range(len(prompts))] == direct
        # cancel mid-reply, then the engine serves the next request unchanged
        h = service.submit(prompts[0], SamplingParams(max_new_tokens=2000, temperature=0,
                                                      ignore_eos=True))
        for ev in h.events(poll_s=0.01):
            if h.text:
                h.cancel()
                break
        assert h.result(timeout=60).metrics.finish_reason == "cancelled"
        assert service.submit(prompts[1], greedy).result(timeout=60).token_ids == direct[1]
    finally:
        service.close()
