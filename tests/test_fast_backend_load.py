"""Load time of the fast path when the continuous-batching runner will serve it: the batch-1
decoder's warm-up (its CUDA graphs, which ``batch_runner_for(FastBackend)`` drops) is skipped, the
``--max-batch 1`` path still warms up."""
from __future__ import annotations

import pytest

from qwen_trt.serving.scheduler import batch_runner_for

from qwen_trt.backends import BackendConfig
from qwen_trt.params import SamplingParams
from qwen_trt.serving import worker


@pytest.fixture
def warmups(monkeypatch):
    from qwen_trt.fast.step.decoder import FastDecoder

    calls = []
    real = FastDecoder.warmup

    def spy(self, *a, **kw):
        calls.append(self)
        return real(self, *a, **kw)

    monkeypatch.setattr(FastDecoder, "warmup", spy)
    return calls


@pytest.mark.parametrize("for_runner", [False, True])
def test_batch1_warmup_only_without_the_runner(tiny_model_dir, warmups, for_runner):
    from qwen_trt.backends import load_backend
    from qwen_trt.backends.fast_backend import FastBackend

    cfg = BackendConfig(model=str(tiny_model_dir), device="cpu", fast="on", max_seq_len=128)
    backend = load_backend(cfg, for_runner=for_runner)
    assert isinstance(backend, FastBackend)
    assert len(warmups) == (0 if for_runner else 1)
    # either way the backend serves: through the runner, or the batch-1 decoder
    if for_runner:
        worker.make_runner(backend, max_batch=4)
    ids = backend.tokenizer.encode("hello")
    out = list(backend.stream(ids, SamplingParams(max_new_tokens=4, temperature=0,
                                                  ignore_eos=True)))
    assert len(out) == 4
    backend.close()


def _spec(**kw):
    runner = kw.pop("runner", None)
    loader = kw.pop("loader", worker.DEFAULT_LOADER)
    return worker.WorkerSpec(BackendConfig(model="m", **kw), loader=loader, runner=runner)


@pytest.mark.parametrize("spec,told", [
    (_spec(), True),                                   # default: the batched runner
    (_spec(max_batch=8), True),
    (_spec(max_batch=1), False),                       # the batch-1 decoder serves
    (_spec(runner="tests.x:runner"), False),           # a named runner: nothing assumed
    (_spec(loader="tests.x:load"), False),             # a named loader gets cfg alone
])
def test_worker_tells_the_default_loader(spec, told):
    seen = []

    def loader(cfg, **kw):
        seen.append(kw)
        return "backend"

    assert worker.load_for_spec(loader, spec) == "backend"
    assert seen == [{"for_runner": True} if told else {}]
