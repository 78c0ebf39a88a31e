"""The fast path's kernel switches, as one frozen :class:`KernelOptions`.

They are read once from the environment (the ``tuning`` group of :mod:`qwen_trt.settings`) the
first time the kernels ask, or set explicitly with :func:`use` (``qwen-trt``'s profiler sets one
per variant, tests set them directly); the launch sites read the object, never the environment.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from qwen_trt import settings


@dataclass(frozen=True)
class KernelOptions:
    pdl: bool = True                 # programmatic dependent launch between decode kernels
    chain: bool = True               # chained greedy decode steps in the batched runner
    attn_preload: bool = True        # first K/V tile loaded before the PDL wait (no variable:
    #                                  the kernel tests and `profile --variants` set it)
    step_compile: bool = True        # the batched step's elementwise pieces compiled
    step_triton: bool = True         # ... as Triton kernels (batched._post_triton): no dynamo
    attn_split: int | None = None    # batch-1 RoPE attention keys per split (None: tuned default)
    paged_split: int | None = None   # paged RoPE attention keys per split (None: tuned default)
    fp8_prefill: str = "auto"        # FP8 weights' prefill: auto | dequant | tensorcore
    fp8_tensor_cores: bool = True    # False: act as if the GPU had none (tests the fallback)
    self_checks: str = "auto"        # auto: skipped when the warm compile cache recorded them
    #                                  passing; always: every start (compile_cache.run_check)
    gemv: Mapping[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    # (n, k) -> (block_n, warps, ctas_per_sm): a GEMV shape's persistent configuration

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "KernelOptions":
        env = environ
        gemv = {}
        for shape, val in settings.prefixed("QWEN_TRT_GEMV_", env).items():
            try:
                n, k = (int(v) for v in shape.split("x"))
                bn, warps, ctas = (int(v) for v in val.replace(":", ",").split(","))
            except ValueError:
                raise settings.SettingError(f"QWEN_TRT_GEMV_{shape}={val!r}: expected "
                                            "QWEN_TRT_GEMV_<N>x<K>=block_n:warps:ctas_per_sm"
                                            ) from None
            gemv[(n, k)] = (bn, warps, ctas)
        return cls(pdl=settings.get("QWEN_TRT_PDL", env), chain=settings.get("QWEN_TRT_CHAIN", env),
                   step_compile=settings.get("QWEN_TRT_STEP_COMPILE", env),
                   step_triton=settings.get("QWEN_TRT_STEP_TRITON", env),
                   attn_split=settings.get("QWEN_TRT_ATTN_SPLIT", env),
                   paged_split=settings.get("QWEN_TRT_PAGED_SPLIT", env),
                   fp8_prefill=settings.get("QWEN_TRT_FP8_PREFILL", env),
                   fp8_tensor_cores=settings.get("QWEN_TRT_FP8_TENSOR_CORES", env),
                   self_checks=settings.get("QWEN_TRT_SELF_CHECKS", env), gemv=gemv)

    def replace(self, **changes) -> "KernelOptions":
        return dataclasses.replace(self, **changes)

    def with_text(self, text: str) -> "KernelOptions":
        """These options changed by ``"name=value,..."`` (field names: ``attn_preload=0``,
        ``paged_split=64``, ``gemv.4096x2560=4:8:2``); ValueError names a bad item."""
        changes: dict = {}
        gemv = dict(self.gemv)
        for item in filter(None, (x.strip() for x in text.split(","))):
            name, sep, val = item.partition("=")
            name, val = name.strip(), val.strip()
            if name.startswith("gemv."):
                try:
                    n, k = (int(v) for v in name[5:].split("x"))
                    gemv[(n, k)] = tuple(int(v) for v in val.split(":"))
                    assert len(gemv[(n, k)]) == 3
                except (ValueError, AssertionError):
                    raise ValueError(f"{item!r}: expected gemv.<N>x<K>=block_n:warps:ctas") from None
                continue
            if not sep or name not in _FIELDS or name == "gemv":
                raise ValueError(f"{item!r}: expected NAME=VALUE, NAME one of "
                                 f"{', '.join(f for f in _FIELDS if f != 'gemv')}, gemv.<N>x<K>")
            kind = _FIELDS[name]
            if kind == "bool":
                try:
                    changes[name] = settings.parse_bool(val)
                except ValueError:
                    raise ValueError(f"{item!r}: {name} takes 1 or 0") from None
                continue
            try:
                changes[name] = None if val.lower() == "none" else int(val)
            except ValueError:
                raise ValueError(f"{item!r}: {name} takes a whole number") from None
        return dataclasses.replace(self, gemv=gemv, **changes)


_FIELDS = {"pdl": "bool", "chain": "bool", "attn_preload": "bool", "step_compile": "bool",
           "step_triton": "bool",
           "attn_split": "int", "paged_split": "int", "gemv": "map"}


_current: KernelOptions | None = None


def options() -> KernelOptions:
    """The options in force (read from the environment on first use)."""
    global _current
    if _current is None:
        _current = KernelOptions.from_env()
    return _current


def configure(opts: KernelOptions | None) -> None:
    """Set the options in force (None: read the environment again on next use)."""
    global _current
    _current = opts


@contextlib.contextmanager
def use(opts: KernelOptions) -> Iterator[KernelOptions]:
    """The options in force inside the block (kernels built or launched there see ``opts``)."""
    global _current
    before = _current
    _current = opts
    try:
        yield opts
    finally:
        _current = before
