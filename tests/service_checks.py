"""Checks that every service handing out RequestHandles must pass, run against the in-process
InferenceService (tests/test_serving.py) and the worker-process WorkerClient
(tests/test_serving_worker.py)."""
from __future__ import annotations

import threading
from collections.abc import Sequence

from qwen_trt.params import SamplingParams
from qwen_trt.serving.events import Delta


def check_threads_get_their_own_replies(service, prompts: Sequence[list[int]],
                                        params: SamplingParams, timeout: float) -> None:
    """The replies of ``prompts`` submitted from one thread each equal their replies one by
    one, and the service counts every request once."""
    expected = [service.submit(ids, params).result(timeout).text for ids in prompts]
    assert len(set(expected)) > 1            # otherwise mixing replies up could not be seen
    served = service.status().served
    got: list[str | None] = [None] * len(prompts)

    def worker(i: int) -> None:
        got[i] = service.submit(prompts[i], params).result(timeout).text

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert got == expected
    assert service.status().served == served + len(prompts)


def check_cancel_mid_reply_leaves_engine_clean(service, ids: list[int], greedy: SamplingParams,
                                               timeout: float) -> None:
    """A request cancelled after its first delta ends "cancelled"; the next request runs to
    its normal end (no cancel flag leaked into it) with the reply it had before."""
    expected = service.submit(ids, greedy).result(timeout)
    long = SamplingParams(max_new_tokens=4000, temperature=0, ignore_eos=True)
    handle = service.submit(ids, long)
    for ev in handle.events(poll_s=0.01):
        if isinstance(ev, Delta):
            handle.cancel()
            break
    cancelled = handle.result(timeout)
    assert cancelled.metrics.finish_reason == "cancelled"
    assert 1 <= cancelled.metrics.tokens < 4000
    again = service.submit(ids, greedy).result(timeout)
    assert again.text == expected.text
    assert again.metrics.finish_reason == expected.metrics.finish_reason
