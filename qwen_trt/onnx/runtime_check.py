"""Run the exported decoder with ONNX Runtime (CPU) and check it against the torch model.

:class:`OrtDecoder` is a small KV-cache loop over the graph written by
:mod:`qwen_trt.onnx.export`: prefill with empty ``past_*`` tensors, then one token per step with
the ``present_*`` outputs fed back. :func:`verify_export` compares its logits (prefill, several
decode steps, a left-padded batch of two) and its greedy tokens with the HF model.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qwen_trt.errors import first_line
from qwen_trt.onnx.export import OnnxExportError, input_names, quiet, require

# |ORT logit - torch logit| must stay within TOLERANCE[dtype] * max(1, max |torch logit|).
TOLERANCE = {"float32": 1e-4, "float16": 2e-2}
DEFAULT_PROMPT = "Hello! In two sentences, what does a KV cache do during decoding?"
DEFAULT_DECODE_STEPS = 4
DEFAULT_GREEDY_TOKENS = 16
_NP_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16"}


class OnnxParityError(OnnxExportError):
    """ONNX Runtime's results differ from torch beyond the tolerance."""


@dataclass
class DecoderStep:
    logits: "object"            # np.ndarray [batch, seq, vocab]
    present: list               # np.ndarray per layer: key_0, value_0, key_1, ...


class OrtDecoder:
    """An ONNX Runtime session on the exported graph, with a greedy KV-cache loop."""

    def __init__(self, model_path: str | Path, threads: int | None = None) -> None:
        require("onnxruntime")
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(model_path), opts,
                                                providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own Fail/InvalidGraph/NotImplemented types
            raise OnnxExportError(f"ONNX Runtime cannot load {model_path}: "
                                  f"{first_line(e)}") from e
        inputs = self.session.get_inputs()
        kv = [i for i in inputs if i.name.startswith("past_key_")]
        if not kv:
            raise OnnxExportError(f"{model_path} has no past_key_* inputs: not a qwen-trt export.")
        self.num_layers = len(kv)
        self.num_kv_heads, self.head_dim = kv[0].shape[1], kv[0].shape[3]
        self.dtype = _NP_DTYPES.get(kv[0].type, "float32")
        self.input_names = input_names(self.num_layers)
        if [i.name for i in inputs] != self.input_names:
            raise OnnxExportError(f"{model_path} inputs {[i.name for i in inputs]} are not "
                                  f"{self.input_names}.")

    def empty_past(self, batch: int) -> list:
        import numpy as np

        return [np.zeros((batch, self.num_kv_heads, 0, self.head_dim), dtype=self.dtype)
                for _ in range(2 * self.num_layers)]

    def run(self, input_ids, attention_mask, position_ids, past: Sequence) -> DecoderStep:
        import numpy as np

        feed = dict(zip(self.input_names, [np.asarray(input_ids, dtype=np.int64),
                                           np.asarray(attention_mask, dtype=np.int64),
                                           np.asarray(position_ids, dtype=np.int64), *past]))
        out = self.session.run(None, feed)
        return DecoderStep(logits=out[0], present=out[1:])

    def step(self, token_ids: Sequence[int], past: Sequence, past_len: int) -> DecoderStep:
        """Batch 1, no padding: feed ``token_ids`` after ``past_len`` cached positions."""
        import numpy as np

        n = len(token_ids)
        ids = np.asarray([list(token_ids)], dtype=np.int64)
        mask = np.ones((1, past_len + n), dtype=np.int64)
        pos = np.arange(past_len, past_len + n, dtype=np.int64)[None, :]
        return self.run(ids, mask, pos, past)

    def greedy(self, prompt_ids: Sequence[int], max_new_tokens: int,
               stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy tokens after ``prompt_ids``; stops after a token in ``stop_ids`` (kept)."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        out: list[int] = []
        step = self.step(prompt_ids, self.empty_past(1), 0)
        length = len(prompt_ids)
        while True:
            tok = int(step.logits[0, -1].argmax())
            out.append(tok)
            if tok in stop_ids or len(out) == max_new_tokens:
                return out
            step = self.step([tok], step.present, length)
            length += 1


# --------------------------------------------------------------------------- parity


@dataclass
class LogitsDiff:
    step: str
    max_abs_diff: float
    ref_max_abs: float

    def ratio(self) -> float:
        return self.max_abs_diff / max(1.0, self.ref_max_abs)


@dataclass
class ParityReport:
    dtype: str
    tolerance: float
    prompt_tokens: int
    logits: list[LogitsDiff] = field(default_factory=list)
    greedy_onnx: list[int] = field(default_factory=list)
    greedy_torch: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def max_abs_diff(self) -> float:
        return max((d.max_abs_diff for d in self.logits), default=0.0)

    @property
    def logits_ok(self) -> bool:
        return all(d.ratio() <= self.tolerance for d in self.logits)

    @property
    def greedy_ok(self) -> bool:
        return self.greedy_onnx == self.greedy_torch

    @property
    def ok(self) -> bool:
        return self.logits_ok and self.greedy_ok

    def first_divergence(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.greedy_onnx, self.greedy_torch)):
            if a != b:
                return i
        same = len(self.greedy_onnx) == len(self.greedy_torch)
        return None if same else min(len(self.greedy_onnx), len(self.greedy_torch))

    def summary(self) -> list[str]:
        lines = [f"logits ({self.dtype}, tolerance {self.tolerance:g} x max(1, max|logit|)):"]
        for d in self.logits:
            mark = "ok" if d.ratio() <= self.tolerance else "FAIL"
            lines.append(f"  {d.step:<24} max|diff| {d.max_abs_diff:.3g}  "
                         f"(max|logit| {d.ref_max_abs:.3g})  {mark}")
        div = self.first_divergence()
        lines.append(f"greedy {len(self.greedy_onnx)} tokens: "
                     + ("identical to HF generate" if div is None
                        else f"differs from HF generate at token {div}: "
                             f"onnx {self.greedy_onnx} vs torch {self.greedy_torch}"))
        return lines

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(max_abs_diff=self.max_abs_diff, logits_ok=self.logits_ok,
                 greedy_ok=self.greedy_ok, ok=self.ok)
        return d


def _diff(step: str, ort_logits, ref) -> LogitsDiff:
    import numpy as np

    ref = ref.float().numpy()
    got = np.asarray(ort_logits, dtype=np.float32)
    if got.shape != ref.shape:
        raise OnnxParityError(f"{step}: ONNX logits shape {got.shape} != torch {ref.shape}")
    return LogitsDiff(step=step, max_abs_diff=float(np.abs(got - ref).max()),
                      ref_max_abs=float(np.abs(ref).max()))


def _cache_kwargs(model) -> dict:
    import inspect

    from transformers import DynamicCache

    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {kw: DynamicCache(config=model.config)}


def compare_decode_logits(decoder: OrtDecoder, model, prompt_ids: Sequence[int],
                          decode_steps: int) -> list[LogitsDiff]:
    """Prefill then ``decode_steps`` single-token steps, each side with its own KV cache; both
    are fed the torch model's greedy token so they see the same inputs."""
    import torch

    diffs = []
    cache = _cache_kwargs(model)
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([list(prompt_ids)]), use_cache=True, **cache).logits
        step = decoder.step(prompt_ids, decoder.empty_past(1), 0)
        diffs.append(_diff(f"prefill ({len(prompt_ids)} tokens)", step.logits, ref))
        length = len(prompt_ids)
        for i in range(decode_steps):
            tok = int(ref[0, -1].argmax())
            ref = model(input_ids=torch.tensor([[tok]]), use_cache=True, **cache).logits
            step = decoder.step([tok], step.present, length)
            length += 1
            diffs.append(_diff(f"decode step {i + 1}", step.logits, ref))
    return diffs


def compare_padded_batch(decoder: OrtDecoder, model, prompts: Sequence[Sequence[int]],
                         pad_id: int) -> LogitsDiff:
    """A left-padded batch through both: exercises the batch axis and the attention mask."""
    import numpy as np
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    step = decoder.run(ids.numpy(), mask.numpy(), pos.numpy(), decoder.empty_past(len(prompts)))
    # Padded positions are garbage on both sides; compare the real tokens only.
    keep = mask.bool().numpy()
    got = np.asarray(step.logits, dtype=np.float32)[keep]
    return _diff(f"batch of {len(prompts)}, left-padded", got, ref[torch.from_numpy(keep)])


def torch_greedy(model, prompt_ids: Sequence[int], max_new_tokens: int,
                 stop_ids: Sequence[int], pad_id: int | None) -> list[int]:
    """HF ``generate`` with greedy decoding and the same stop tokens."""
    import torch
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                           eos_token_id=list(stop_ids) or None, pad_token_id=pad_id,
                           temperature=None, top_p=None, top_k=None)
    ids = torch.tensor([list(prompt_ids)])
    with quiet(), torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             generation_config=cfg)
    return out[0, len(prompt_ids):].tolist()


def stop_ids_of(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def default_prompt_ids(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": DEFAULT_PROMPT}]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    except (ValueError, AttributeError, TypeError):
        return tokenizer.encode(DEFAULT_PROMPT, add_special_tokens=False)


def verify_export(model_path: str | Path, model, prompt_ids: Sequence[int], *, dtype: str,
                  decode_steps: int = DEFAULT_DECODE_STEPS,
                  greedy_tokens: int = DEFAULT_GREEDY_TOKENS,
                  pad_id: int | None = None, decoder: OrtDecoder | None = None) -> ParityReport:
    """Compare the ONNX graph under ONNX Runtime with ``model`` (the HF model it came from)."""
    t0 = time.perf_counter()
    decoder = decoder or OrtDecoder(model_path)
    if decoder.dtype != dtype:
        raise OnnxParityError(f"{model_path} holds {decoder.dtype} KV tensors, expected {dtype}.")
    report = ParityReport(dtype=dtype, tolerance=TOLERANCE[dtype],
                          prompt_tokens=len(prompt_ids))
    try:
        report.logits = compare_decode_logits(decoder, model, prompt_ids, decode_steps)
        half = max(1, len(prompt_ids) // 2)
        pad = pad_id if pad_id is not None else 0
        report.logits.append(compare_padded_batch(decoder, model,
                                                  [prompt_ids, prompt_ids[:half]], pad))
        stop = stop_ids_of(model)
        report.greedy_onnx = decoder.greedy(prompt_ids, greedy_tokens, stop)
        report.greedy_torch = torch_greedy(model, prompt_ids, greedy_tokens, stop, pad_id)
    except OnnxExportError:
        raise
    except Exception as e:  # ORT's NOT_IMPLEMENTED for a dtype, shape errors, ...
        raise OnnxParityError(f"ONNX Runtime could not run {model_path}: "
                              f"{type(e).__name__}: {first_line(e)}") from e
    report.seconds = time.perf_counter() - t0
    return report
