"""Fake ``tensorrt_llm.bindings.KVCacheType`` (C++ enum; builder.py @008b2b8d and
runtime/model_runner_cpp.py @03832911 import it from here; ``from_string`` is used by
commands/build.py for ``--kv_cache_type``)."""
import enum


class KVCacheType(enum.Enum):
    CONTINUOUS = 0
    PAGED = 1
    DISABLED = 2

    @staticmethod
    def from_string(s: str) -> "KVCacheType":
        return KVCacheType[s.upper()]
