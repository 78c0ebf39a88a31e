"""Fake ``tensorrt_llm.runtime.ModelRunnerCpp`` over a scripted fake executor.

Mirrors tensorrt_llm/runtime/model_runner_cpp.py @03832911:

* ``from_dir(engine_dir, *, ...keyword-only...)`` with the same parameter names (a wrong name is
  a TypeError, as with the real signature); runtime limits must not exceed the engine's.
* ``generate(batch_input_ids, *, ..., streaming, max_new_tokens, end_id, pad_id,
  stop_words_list, return_dict, output_sequence_lengths, **kwargs)``: sampling kwargs filtered
  by the same accepted list, ``num_beams``->``beam_width``, ``random_seed``->``seed``, top_p 0.0
  -> None; requests enqueued with ``self.executor.enqueue_requests`` at call time; streaming
  returns a generator that calls ``self.executor.await_responses()`` until every request is
  final and yields ``_fill_output``-shaped dicts: ``output_ids`` int32 [batch, beams,
  max_seq_len], prompt-prefixed, cumulative, end_id padded; ``sequence_lengths`` int32
  [batch, beams] including the prompt; an error response raises ``RuntimeError(error_msg)``;
  a response for an unknown request id fails like the real ``request_ids.index``.

The executor mirrors the pybind ``Executor`` (cpp/tensorrt_llm/pybind/executor/executor.cpp
@03961722): ``enqueue_requests(requests) -> ids``, ``await_responses(timeout=None)``,
``cancel_request(id)``, ``can_enqueue_requests()``, ``shutdown()``. What it "generates" is set
by tests: ``FakeExecutor.script`` (tokens per request), ``chunks`` (how many tokens each
response carries), ``include_end_id`` (whether the end id appears in the output).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

import tensorrt_llm

ACCEPTED_SAMPLING = ["num_beams", "top_k", "top_p", "top_p_min", "top_p_reset_ids", "top_p_decay",
                     "temperature", "min_tokens", "beam_search_diversity_rate",
                     "repetition_penalty", "presence_penalty", "frequency_penalty",
                     "length_penalty", "early_stopping", "no_repeat_ngram_size", "random_seed",
                     "num_return_sequences", "min_p", "beam_width_array"]


@dataclass
class SamplingConfig:
    beam_width: int = 1
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    seed: int | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class Request:
    input_token_ids: list[int]
    max_tokens: int
    end_id: int | None
    pad_id: int | None
    stop_words: list[list[int]] | None
    sampling_config: SamplingConfig
    streaming: bool
    # executor-side state
    produced: list[int] = field(default_factory=list)
    sent: int = 0
    cancelled: bool = False
    final_sent: bool = False


@dataclass
class Result:
    output_token_ids: list[list[int]]
    is_final: bool
    sequence_index: int = 0


@dataclass
class Response:
    request_id: int
    result: Result | None
    error_msg: str = ""

    def has_error(self) -> bool:
        return bool(self.error_msg)


class FakeExecutor:
    """Serves requests from ``script``; one ``await_responses`` call = one batch of responses."""

    script: list[int] = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    chunks: list[int] = [1]            # tokens per response, cycled
    include_end_id: bool = True
    error_after: int | None = None     # respond with an error after this many responses
    late_cancel_ack: bool = False      # a cancelled request's final response comes only after
                                       # the next request is enqueued

    def __init__(self):
        self.requests: dict[int, Request] = {}
        self.next_id = 1
        self.cancelled: list[int] = []
        self.calls = 0
        self.shut = False
        self.timeouts: list = []

    def can_enqueue_requests(self) -> bool:
        return True

    def enqueue_requests(self, requests):
        ids = []
        for r in requests:
            rid, self.next_id = self.next_id, self.next_id + 1
            self._generate(r)
            self.requests[rid] = r
            ids.append(rid)
        tensorrt_llm.CALLS.append(("enqueue_requests", {"ids": ids, "requests": requests}))
        return ids

    def _generate(self, r: Request) -> None:
        """What the model would produce: script until end_id / a stop word / max_tokens."""
        out, stops = [], {tuple(w) for w in (r.stop_words or [])}
        for tok in self.script:
            if len(out) == r.max_tokens:
                break
            if tok == r.end_id:
                if self.include_end_id:
                    out.append(tok)
                break
            out.append(tok)
            if (tok,) in stops:
                break
        r.produced = out

    def cancel_request(self, id=None):
        tensorrt_llm.CALLS.append(("cancel_request", {"id": id}))
        self.cancelled.append(id)
        if id in self.requests:
            self.requests[id].cancelled = True

    def await_responses(self, timeout=None):
        self.calls += 1
        self.timeouts.append(timeout)
        out = []
        for rid, r in self.requests.items():
            if r.final_sent:
                continue
            if r.cancelled and self.late_cancel_ack and rid == self.next_id - 1:
                continue   # held back until another request is enqueued
            if self.error_after is not None and self.calls > self.error_after:
                r.final_sent = True
                out.append(Response(rid, None, error_msg="Encountered an error in forwardAsync"))
                continue
            if r.cancelled:
                r.final_sent = True
                out.append(Response(rid, Result([[]], is_final=True)))
                continue
            n = self.chunks[(self.calls - 1) % len(self.chunks)]
            new = r.produced[r.sent:r.sent + n]
            r.sent += len(new)
            final = r.sent >= len(r.produced)
            r.final_sent = final
            out.append(Response(rid, Result([new], is_final=final)))
        return out

    def shutdown(self):
        self.shut = True


class ModelRunnerCpp:
    def __init__(self, executor, max_batch_size, max_input_len, max_seq_len, max_beam_width):
        self.executor = executor
        self.max_batch_size = max_batch_size
        self.max_input_len = max_input_len
        self.max_seq_len = max_seq_len
        self.max_beam_width = max_beam_width
        self.widths: list[int] = []    # padded length of each streamed item (test hook)

    @classmethod
    def from_dir(cls, engine_dir: str, *, lora_dir=None, rank: int = 0, max_batch_size=None,
                 max_input_len=None, max_output_len=None, max_beam_width=None,
                 max_attention_window_size=None, sink_token_length=None,
                 kv_cache_free_gpu_memory_fraction=None, cross_kv_cache_fraction=None,
                 medusa_choices=None, eagle_choices=None, eagle_posterior_threshold=None,
                 eagle_use_dynamic_tree=False, eagle_dynamic_tree_max_top_k=None,
                 lookahead_config=None, debug_mode=False, lora_ckpt_source="hf",
                 use_gpu_direct_storage=False, gpu_weights_percent=1,
                 max_tokens_in_paged_kv_cache=None, kv_cache_enable_block_reuse=False,
                 enable_chunked_context=False, is_enc_dec=False, multi_block_mode=True,
                 enable_context_fmha_fp32_acc=None, cuda_graph_mode=None,
                 logits_processor_map=None, device_ids=None, is_orchestrator_mode=False,
                 use_runtime_defaults=True, gather_generation_logits=False,
                 use_variable_beam_width_search=False, mm_embedding_offloading=False):
        args = {k: v for k, v in locals().items() if k not in ("cls",)}
        tensorrt_llm.CALLS.append(("ModelRunnerCpp.from_dir", args))
        bc = json.loads(Path(engine_dir, "config.json").read_text())["build_config"]
        if max_batch_size is None:
            max_batch_size = bc["max_batch_size"]
        assert max_batch_size <= bc["max_batch_size"]
        if max_input_len is None:
            max_input_len = bc["max_input_len"]
        if max_output_len is None:
            max_seq_len = bc["max_seq_len"]
        else:
            max_seq_len = max_input_len + max_output_len
            assert max_seq_len <= bc["max_seq_len"]
        if max_beam_width is None:
            max_beam_width = bc["max_beam_width"]
        assert max_beam_width <= bc["max_beam_width"]
        return cls(FakeExecutor(), max_batch_size, max_input_len, max_seq_len, max_beam_width)

    def generate(self, batch_input_ids, *, position_ids=None, encoder_input_ids=None,
                 sampling_config=None, lora_uids=None, streaming=False, stopping_criteria=None,
                 max_new_tokens=1, end_id=None, pad_id=None, bad_words_list=None,
                 stop_words_list=None, return_dict=False, output_sequence_lengths=False,
                 output_log_probs=False, output_cum_log_probs=False,
                 return_all_generated_tokens=False, **kwargs):
        if stopping_criteria is not None:
            raise RuntimeError("Stopping criteria is not supported in C++ session.")
        ids_list = [a.tolist() for a in batch_input_ids]
        sp = {k: v for k, v in kwargs.items() if k in ACCEPTED_SAMPLING}
        if "num_beams" in sp:
            sp["beam_width"] = sp.pop("num_beams")
        if "random_seed" in sp:
            sp["seed"] = sp.pop("random_seed")
        if sp.get("top_p") == 0.0:
            sp["top_p"] = None
        known = {k: sp.pop(k) for k in ("beam_width", "top_k", "top_p", "temperature", "seed")
                 if k in sp}
        sampling = SamplingConfig(**known, extra=sp)
        tensorrt_llm.CALLS.append(("generate", {
            "batch_input_ids": batch_input_ids, "max_new_tokens": max_new_tokens,
            "end_id": end_id, "pad_id": pad_id, "stop_words_list": stop_words_list,
            "streaming": streaming, "return_dict": return_dict,
            "output_sequence_lengths": output_sequence_lengths, "sampling": sampling,
            "kwargs": kwargs}))
        if len(ids_list) > self.max_batch_size:
            raise RuntimeError("Input batch size exceeds the engine or specified limit")
        longest = max(len(x) for x in ids_list)
        if longest > self.max_input_len:
            raise RuntimeError(f"Maximum input length ({longest}) exceeds the engine or "
                               f"specified limit ({self.max_input_len})")
        if longest + max_new_tokens > self.max_seq_len:
            raise RuntimeError(f"Maximum input length ({longest}) + maximum new tokens "
                               f"({max_new_tokens}) exceeds the engine or specified limit "
                               f"({self.max_seq_len})")
        stops = stop_words_list or [None] * len(ids_list)
        requests = [Request(input_token_ids=ids, max_tokens=max_new_tokens, end_id=end_id,
                            pad_id=pad_id, stop_words=sw, sampling_config=sampling,
                            streaming=streaming) for ids, sw in zip(ids_list, stops)]
        request_ids = self.executor.enqueue_requests(requests)
        if not streaming:
            raise NotImplementedError("the fake only streams")
        return self._stream(request_ids, ids_list, end_id, return_dict, output_sequence_lengths)

    def _stream(self, request_ids, ids_list, end_id, return_dict, output_sequence_lengths):
        output_ids = [[list(ids)] for ids in ids_list]
        finished = set()
        while finished != set(request_ids):
            responses = self.executor.await_responses()
            for response in responses:
                if response.result is not None and response.result.is_final:
                    finished.add(response.request_id)
            for response in responses:
                if response.has_error():
                    raise RuntimeError(response.error_msg)
                b = request_ids.index(response.request_id)
                output_ids[b][response.result.sequence_index] += response.result.output_token_ids[0]
            lengths = [[len(t) for t in beams] for beams in output_ids]
            padded = [[t + [end_id] * (self.max_seq_len - len(t)) for t in beams]
                      for beams in output_ids]
            out_ids = torch.tensor(padded, dtype=torch.int32)
            self.widths.append(out_ids.shape[-1])
            if not return_dict:
                yield out_ids
                continue
            outputs = {"output_ids": out_ids}
            if output_sequence_lengths:
                outputs["sequence_lengths"] = torch.tensor(lengths, dtype=torch.int32)
            yield outputs
