"""The conversation as a file to download: Markdown to read, JSON to process.

Both are built from a :meth:`ChatState.snapshot` plus the settings in use, so what is saved is
exactly the committed history (a reply still streaming is not in it). The JSON holds every
message, the settings (sampling, system prompt, engine) and each reply's metrics and the
sampling it was generated with.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone

FORMAT = "qwen-trt-transcript/1"


def _turns(snap: dict) -> list[tuple[dict, dict, dict]]:
    msgs, notes = snap.get("messages", []), snap.get("notes", [])
    out = []
    for i in range(0, len(msgs) - 1, 2):
        u, a = msgs[i], msgs[i + 1]
        if u["role"] == "user" and a["role"] == "assistant":
            note = notes[len(out)] if len(out) < len(notes) else {}
            out.append((u, a, note))
    return out


def to_json(snap: dict, settings: dict, engine: str = "") -> str:
    doc = {
        "format": FORMAT,
        "exported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "engine": engine,
        "settings": dict(settings, system_prompt=snap.get("system_prompt")),
        "messages": [{"role": m["role"], "content": m["content"],
                      **({"interrupted": True} if m.get("interrupted") else {})}
                     for m in snap.get("messages", [])],
        "replies": [{"turn": i + 1, "metrics": n.get("metrics", {}), "params": n.get("params", {}),
                     "footer": n.get("footer", ""), "dropped_turns": n.get("dropped_turns", 0)}
                    for i, (_, _, n) in enumerate(_turns(snap))],
    }
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def _fence(text: str) -> str:
    """A fence longer than any backtick run in ``text``."""
    run = longest = 0
    for c in text:
        run = run + 1 if c == "`" else 0
        longest = max(longest, run)
    return "`" * max(3, longest + 1)


def to_markdown(snap: dict, settings: dict, engine: str = "") -> str:
    """Readable transcript. Each message is quoted verbatim in a fenced block, so its own
    Markdown (or HTML) is shown as written, never interpreted by the viewer."""
    lines = ["# qwen-trt chat", ""]
    if engine:
        lines += [f"- engine: {engine}"]
    lines += [f"- {k}: {v}" for k, v in settings.items()]
    if snap.get("system_prompt"):
        sp = snap["system_prompt"]
        lines += ["", "## System prompt", "", _fence(sp) + "text", sp, _fence(sp)]
    for i, (u, a, note) in enumerate(_turns(snap), 1):
        lines += ["", f"## Turn {i}", "", "**User**", "", _fence(u["content"]) + "text",
                  u["content"], _fence(u["content"]), "", "**Assistant**", "",
                  _fence(a["content"]) + "text", a["content"], _fence(a["content"])]
        if note.get("footer"):
            lines += ["", f"*{note['footer']}*"]
    return "\n".join(lines) + "\n"
