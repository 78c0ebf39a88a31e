"""Fake ``tensorrt_llm.runtime.ModelRunnerCpp`` over the fake executor (``bindings.executor``).

Mirrors tensorrt_llm/runtime/model_runner_cpp.py @03832911:

* ``from_dir(engine_dir, *, ...keyword-only...)`` with the same parameter names (a wrong name is
  a TypeError, as with the real signature); runtime limits must not exceed the engine's; the
  runner keeps the executor as ``runner.executor``.
* ``generate(batch_input_ids, *, ..., streaming, max_new_tokens, end_id, pad_id,
  stop_words_list, return_dict, output_sequence_lengths, **kwargs)``: sampling kwargs filtered by
  the same accepted list, ``num_beams``->``beam_width``, ``random_seed``->``seed``, top_p 0.0 ->
  None, one ``trtllm.Request`` per prompt enqueued with ``self.executor.enqueue_requests`` at call
  time. Streaming returns ``_stream``, which loops on ``self.executor.await_responses()`` -- no
  request id, no timeout -- and reads ``response.result.is_final`` of every response *before*
  ``_fill_output`` checks ``has_error()``; so an error response surfaces as the executor's
  generic "Cannot get the result for a response with an error", and a response of another
  request fails ``request_ids.index`` (two concurrent generate() calls steal each other's
  responses). ``_fill_output`` yields ``output_ids`` int32 [batch, beams, max_seq_len],
  prompt-prefixed, cumulative, end_id padded, and ``sequence_lengths`` (prompt included), both
  **on the GPU** (``device=cuda_device``): the fake returns :class:`CudaTensor` stand-ins.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

import tensorrt_llm
import tensorrt_llm.bindings.executor as trtllm
from tensorrt_llm.bindings.executor import Executor, FakeExecutor  # noqa: F401

ACCEPTED_SAMPLING = ["num_beams", "top_k", "top_p", "top_p_min", "top_p_reset_ids", "top_p_decay",
                     "temperature", "min_tokens", "beam_search_diversity_rate",
                     "repetition_penalty", "presence_penalty", "frequency_penalty",
                     "length_penalty", "early_stopping", "no_repeat_ngram_size", "random_seed",
                     "num_return_sequences", "min_p", "beam_width_array"]

HOST_COPIES = {"elements": 0}   # elements copied device -> host through CudaTensor


class CudaTensor:
    """Stands in for a CUDA tensor on a machine without one: indexing stays "on the device";
    ``tolist()``, ``item()``, ``cpu()`` and ``int()`` copy to the host (counted in
    ``HOST_COPIES``); ``numpy()`` fails as torch does for a CUDA tensor."""

    device = torch.device("cuda", 0)

    def __init__(self, t: torch.Tensor):
        self._t = t

    shape = property(lambda self: self._t.shape)
    dtype = property(lambda self: self._t.dtype)
    is_cuda = True

    def dim(self):
        return self._t.dim()

    def size(self, *a):
        return self._t.size(*a)

    def __len__(self):
        return len(self._t)

    def __getitem__(self, idx):
        return CudaTensor(self._t[idx])

    def __iter__(self):
        return (CudaTensor(x) for x in self._t)

    def _host(self) -> torch.Tensor:
        HOST_COPIES["elements"] += self._t.numel()
        return self._t

    def tolist(self):
        return self._host().tolist()

    def item(self):
        return self._host().item()

    def __int__(self):
        return int(self.item())

    def __index__(self):
        return int(self.item())

    def cpu(self):
        return self._host().clone()

    def numpy(self):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to "
                        "copy the tensor to host memory first.")

    def __repr__(self):
        return f"CudaTensor({self._t!r}, device='cuda:0')"


class ModelRunnerCpp:
    def __init__(self, executor, max_batch_size, max_input_len, max_seq_len, max_beam_width):
        self.executor = executor
        self.max_batch_size = max_batch_size
        self.max_input_len = max_input_len
        self.max_seq_len = max_seq_len
        self.max_beam_width = max_beam_width

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
        executor = Executor(max_batch_size, max_input_len, max_seq_len)
        return cls(executor, max_batch_size, max_input_len, max_seq_len, max_beam_width)

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
        sampling = trtllm.SamplingConfig(**sp)
        tensorrt_llm.CALLS.append(("generate", {
            "batch_input_ids": batch_input_ids, "max_new_tokens": max_new_tokens,
            "end_id": end_id, "pad_id": pad_id, "stop_words_list": stop_words_list,
            "streaming": streaming, "sampling": sampling, "kwargs": kwargs}))
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
        requests = [trtllm.Request(input_token_ids=ids, max_tokens=max_new_tokens, end_id=end_id,
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
                if response.result.is_final:          # before has_error(), as upstream
                    finished.add(response.request_id)
            yield self._fill_output(responses, output_ids, request_ids, end_id, return_dict,
                                    output_sequence_lengths)

    def _fill_output(self, responses, output_ids, request_ids, end_id, return_dict,
                     output_sequence_lengths):
        for response in responses:
            if response.has_error():
                raise RuntimeError(response.error_msg)
            result = response.result
            b = request_ids.index(response.request_id)
            output_ids[b][result.sequence_index] += result.output_token_ids[0]
        lengths = [[len(t) for t in beams] for beams in output_ids]
        padded = copy.deepcopy(output_ids)
        for beams in padded:
            for t in beams:
                t += [end_id] * (self.max_seq_len - len(t))
        out_ids = CudaTensor(torch.tensor(padded, dtype=torch.int32))
        if not return_dict:
            return out_ids
        outputs = {"output_ids": out_ids}
        if output_sequence_lengths:
            outputs["sequence_lengths"] = CudaTensor(torch.tensor(lengths, dtype=torch.int32))
        return outputs
