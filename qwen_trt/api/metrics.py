"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Counted here: requests by outcome, tokens, time to first token (HTTP receive -> first text, so
queueing is included), decode tokens/s per request, and 4xx / 5xx responses by endpoint and status
(counted by :mod:`qwen_trt.api.access`). Read from the service at scrape time: queue depth, running
requests and KV-cache use, when its ``status()`` reports them.

Beside ours, the gauges routers read under vLLM's names, labelled ``model_name`` (the served id):
the Gateway API Inference Extension's model-server protocol
(kubernetes-sigs/gateway-api-inference-extension, docs/proposals/003-model-server-protocol) and
llm-d's endpoint picker scrape ``vllm:num_requests_waiting`` (requests accepted and not yet
started by the engine), ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (0-1; also as
its older name ``vllm:gpu_cache_usage_perc``) and optionally ``vllm:cache_config_info`` (labels
``block_size``, ``num_gpu_blocks``; value 1). Waiting and running are the API's own counts, so a
request waiting for an engine restart is queued too.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKS_BUCKETS = (1, 5, 10, 25, 50, 100, 200, 400, 800, 1600, 3200)


class _ServiceCollector:
    """Gauges read from ``status()`` on every scrape (whatever fields it has)."""

    def __init__(self, status: Callable[[], object], api_waiting: Callable[[], int],
                 api_running: Callable[[], int], info: Callable[[], object] | None = None,
                 model_name: str = "") -> None:
        self._status, self._waiting, self._running = status, api_waiting, api_running
        self._info = info
        self._model = model_name

    def collect(self):
        yield from self._kernels()
        waiting, running = self._waiting(), self._running()
        yield _gauge("qwen_trt_requests_waiting", "API requests not yet started by the engine",
                     waiting)
        yield _gauge("qwen_trt_requests_running", "API requests the engine is generating",
                     running)
        yield self._vllm("vllm:num_requests_waiting",
                         "requests waiting to be started by the engine", waiting)
        yield self._vllm("vllm:num_requests_running", "requests the engine is generating",
                         running)
        try:
            st = self._status()
        except Exception:  # a dead engine: /health says so; metrics stay scrapeable
            return
        queued = getattr(st, "queued", None)
        if queued is None:
            queued = getattr(st, "waiting", None)
        if queued is not None:
            yield _gauge("qwen_trt_engine_queue_depth", "requests queued in the engine", queued)
        busy = getattr(st, "busy", None)
        running = getattr(st, "running", None)
        if running is None and busy is not None:
            running = int(bool(busy))
        if running is not None:
            yield _gauge("qwen_trt_engine_running", "requests the engine runs now", running)
        runner = getattr(st, "runner", None) or {}     # the worker's RunnerStats, as a dict
        used = getattr(st, "kv_blocks_used", runner.get("kv_blocks_used"))
        total = getattr(st, "kv_blocks_total", runner.get("kv_blocks_total"))
        usage = getattr(st, "kv_usage", None)
        if usage is None and used is not None and total:
            usage = used / total
        if usage is not None:
            yield _gauge("qwen_trt_kv_cache_usage_ratio", "KV-cache blocks in use (0-1)", usage)
            yield self._vllm("vllm:kv_cache_usage_perc", "KV-cache blocks in use (0-1)", usage)
            yield self._vllm("vllm:gpu_cache_usage_perc",
                             "KV-cache blocks in use (0-1; vLLM's older name)", usage)
        block_size = (runner.get("extra") or {}).get("block_size")
        if block_size and total:
            g = GaugeMetricFamily("vllm:cache_config_info", "the paged KV cache's layout",
                                  labels=["model_name", "block_size", "num_gpu_blocks"])
            g.add_metric([self._model, str(block_size), str(total)], 1.0)
            yield g
        cached, prompt = getattr(st, "cached_tokens", None), getattr(st, "prompt_tokens", None)
        if cached is not None and prompt:
            yield _gauge("qwen_trt_prefix_cache_hit_ratio",
                         "prompt tokens served from the prefix cache, since start (0-1)",
                         cached / prompt)
        restarts = getattr(st, "restarts", None)
        if restarts is not None:
            yield _gauge("qwen_trt_engine_restarts", "engine process restarts after a crash",
                         restarts)
        yield from self._spec((runner.get("extra") or {}).get("spec_decode"))

    def _spec(self, spec: dict | None):
        """Speculative decoding's counters (vLLM's ``spec_decode_*`` are the model), under our
        names and vLLM's: verify steps, draft tokens, accepted tokens, accepted per position."""
        if not spec:
            return
        for ours, theirs, key, doc in (
                ("qwen_trt_spec_decode_num_drafts", "vllm:spec_decode_num_drafts", "drafts",
                 "verify steps of a sequence with drafts"),
                ("qwen_trt_spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens",
                 "draft_tokens", "draft tokens verified"),
                ("qwen_trt_spec_decode_num_accepted_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "accepted_tokens",
                 "draft tokens accepted")):
            for name, labels, values in ((ours, [], []), (theirs, ["model_name"], [self._model])):
                c = CounterMetricFamily(name, doc, labels=labels)
                c.add_metric(values, float(spec.get(key, 0)))
                yield c
        for name, labels, values in (("qwen_trt_spec_decode_num_accepted_tokens_per_pos",
                                      ["position"], []),
                                     ("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      ["model_name", "position"], [self._model])):
            c = CounterMetricFamily(name, "draft tokens accepted at each draft position",
                                    labels=labels)
            for i, n in enumerate(spec.get("accepted_per_pos") or []):
                c.add_metric(values + [str(i)], float(n))
            yield c


    def _kernels(self):
        """``qwen_trt_kernel_path{family, path, fallback} 1`` per kernel family of the fast path
        (``fallback="1"``: a much slower path than its fast one)."""
        try:
            info = self._info() if self._info is not None else None
        except Exception:  # noqa: BLE001 - no engine info yet
            info = None
        paths = getattr(info, "kernels", None) or {}
        if not paths:
            return
        slow = getattr(info, "slow_kernels", None) or {}
        g = GaugeMetricFamily("qwen_trt_kernel_path", "the path each fast-path kernel family "
                              "runs (fallback=1: a much slower one than its fast path)",
                              labels=["family", "path", "fallback"])
        for family, path in sorted(paths.items()):
            g.add_metric([family, str(path), "1" if family in slow else "0"], 1.0)
        yield g
    def _vllm(self, name: str, doc: str, value) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self._model], float(value))
        return g


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], float(value))
    return g


class ServerMetrics:
    def __init__(self, status: Callable[[], object], api_waiting: Callable[[], int],
                 api_running: Callable[[], int], info: Callable[[], object] | None = None,
                 model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("qwen_trt_requests", "chat completion requests by outcome",
                                ["outcome"], registry=r)
        self.prompt_tokens = Counter("qwen_trt_prompt_tokens", "prompt tokens received",
                                     registry=r)
        self.generation_tokens = Counter("qwen_trt_generation_tokens", "tokens generated",
                                         registry=r)
        self.ttft = Histogram("qwen_trt_time_to_first_token_seconds",
                              "request received -> first text sent (queueing included)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tok_s = Histogram("qwen_trt_decode_tokens_per_second",
                               "decode rate of each finished request", buckets=TOKS_BUCKETS,
                               registry=r)
        self.http_errors = Counter("qwen_trt_http_errors",
                                   "4xx and 5xx responses by endpoint (route path) and status",
                                   ["endpoint", "status"], registry=r)
        r.register(_ServiceCollector(status, api_waiting, api_running, info, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
