"""The sidebar's line about the fast path's kernels: empty on the fast path, a warning when a
kernel family fell back to a much slower one (:mod:`qwen_trt.backends.kernel_paths`)."""
from __future__ import annotations

MAX_WHY_CHARS = 160        # a fallback's reason, as the sidebar quotes it


def slow_path_note(info) -> str:
    """One Markdown line naming each kernel family on a slow path and why ("" when none)."""
    slow = dict(getattr(info, "slow_kernels", None) or {})
    if not slow:
        return ""
    paths = getattr(info, "kernels", None) or {}
    parts = []
    for family, why in slow.items():
        why = str(why).replace("`", "'")
        why = why if len(why) <= MAX_WHY_CHARS else why[:MAX_WHY_CHARS - 1] + "…"
        path = str(paths.get(family, "?")).replace("`", "'")
        parts.append(f"{family} runs `{path}`: `{why}`")     # code spans: shown as written
    return ("**Slow path:** " + "; ".join(parts)
            + ". Replies are much slower than the fast path; see docs/fast-path.md.")
