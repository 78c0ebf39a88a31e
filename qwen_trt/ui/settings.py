"""The sidebar's sampling controls: one spec per slider, and the SamplingParams they make.

The app draws a slider per :data:`SLIDERS` entry (key, label, range, step, default) and turns
the values into :class:`SamplingParams` here; the values are checked once, by SamplingParams.
A control whose field the installed SamplingParams lacks is left out.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from qwen_trt.params import (DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_K,
                             DEFAULT_TOP_P, SamplingParams)


@dataclass(frozen=True)
class SliderSpec:
    key: str                      # the SamplingParams field and the widget key
    label: str
    lo: float
    hi: float
    default: float
    step: float
    help: str = ""


def _default(name: str, fallback: float) -> float:
    for f in dataclasses.fields(SamplingParams):
        if f.name == name and f.default is not dataclasses.MISSING:
            return f.default
    return fallback


_ALL = (
    SliderSpec("max_new_tokens", "Max length (new tokens)", 128, 4096, DEFAULT_MAX_NEW_TOKENS, 64),
    SliderSpec("temperature", "Temperature (0 = greedy)", 0.0, 1.5, DEFAULT_TEMPERATURE, 0.05),
    SliderSpec("top_p", "Top-p", 0.05, 1.0, DEFAULT_TOP_P, 0.05),
    SliderSpec("top_k", "Top-k (0 = off)", 0, 100, DEFAULT_TOP_K, 1),
    SliderSpec("presence_penalty", "Presence penalty", 0.0, 2.0,
               _default("presence_penalty", 0.0), 0.1,
               "Lowers the odds of every token already in the reply; Qwen suggests 0–2 "
               "against endless repetition."),
    SliderSpec("repetition_penalty", "Repetition penalty (1 = off)", 1.0, 2.0,
               _default("repetition_penalty", 1.0), 0.05,
               "Divides the scores of tokens already in the prompt or reply."),
)
_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
SLIDERS: tuple[SliderSpec, ...] = tuple(s for s in _ALL if s.key in _FIELDS)
INT_KEYS = frozenset({"max_new_tokens", "top_k"})


def _cast(spec: SliderSpec):
    return int if spec.key in INT_KEYS else float


def slider_args(spec: SliderSpec) -> dict:
    """Keyword arguments for ``st.slider`` (ints stay ints, so Streamlit draws an int slider).
    No ``value``: the value is in session state (:func:`slider_defaults` first, or the one a
    reload restores); Streamlit warns about a widget given both."""
    cast = _cast(spec)
    return dict(label=spec.label, min_value=cast(spec.lo), max_value=cast(spec.hi),
                step=cast(spec.step), key=spec.key, help=spec.help or None)


def slider_defaults() -> dict:
    """Each slider's starting value, by widget key (ints for int sliders)."""
    return {spec.key: _cast(spec)(spec.default) for spec in SLIDERS}


def params_from(values: Mapping) -> SamplingParams:
    """SamplingParams from the widget values (a missing one takes its default)."""
    kw = {}
    for spec in SLIDERS:
        v = values.get(spec.key, spec.default)
        kw[spec.key] = int(v) if spec.key in INT_KEYS else float(v)
    return SamplingParams(**kw)


def settings_dict(params: SamplingParams) -> dict:
    """The sidebar's settings as plain data (transcript header)."""
    return {s.key: getattr(params, s.key) for s in SLIDERS}
