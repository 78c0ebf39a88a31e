"""``qwen-trt chat``: interactive multi-turn REPL that streams, or one-shot with ``--prompt``."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading

from qwen_trt.serving.session import ChatSession, check_message, check_room, valid_text
from qwen_trt.errors import QwenTrtError
from qwen_trt.ui.text import user_error
from qwen_trt.options import add_backend_args, config_from
from qwen_trt.params import (DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_K,
                             DEFAULT_TOP_P, SamplingParams)

HELP = "commands: /clear (forget the conversation), /exit (quit)"


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat in the terminal (streams tokens)")
    add_backend_args(p)
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P)
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--prompt", default=None, help="one message, print the reply and exit")
    p.add_argument("--json", action="store_true", help="print one JSON object per reply")
    p.set_defaults(func=run)


def _params(args) -> SamplingParams:
    try:
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as e:
        raise QwenTrtError(str(e)) from e


def reply_once(service, session: ChatSession, text: str, params: SamplingParams, *,
               as_json: bool, out=None) -> None:
    """Stream one reply from the engine ``service`` to ``out`` (stdout); Ctrl-C stops it and
    keeps the partial reply."""
    from qwen_trt.serving.events import Delta, Failed

    out = out or sys.stdout
    info = service.info
    plan = session.prepare(text, max_input_len=info.max_input_len, max_seq_len=info.max_seq_len,
                           max_new_tokens=params.max_new_tokens)
    handle = service.submit_plan(plan, params)    # ids to our engine, messages to a server
    try:
        for ev in handle.events(poll_s=1.0):
            if isinstance(ev, Delta) and not as_json:
                out.write(ev.text)
                out.flush()
            elif isinstance(ev, Failed):
                if handle.text:       # e.g. the server went away mid-reply: keep what came
                    session.add_exchange(text, handle.text, interrupted=True)
                    if not as_json:
                        out.write("\n")
                raise ev.error
    except KeyboardInterrupt:
        handle.cancel()
    reply = handle.result()
    session.add_exchange(text, reply.text, interrupted=reply.metrics.finish_reason == "cancelled",
                         reply_ids=reply.token_ids)
    if as_json:
        out.write(json.dumps(reply.to_json(), ensure_ascii=False) + "\n")
    else:
        m = reply.metrics
        note = f" · dropped {plan.dropped_turns} old turn(s) to fit" if plan.dropped_turns else ""
        print(f"\n[{m.finish_reason} · ttft {m.ttft_ms:.0f} ms · {m.tokens} tok · "
              f"{m.decode_tok_s:.1f} tok/s{note}]", file=sys.stderr)
    out.flush()


@contextlib.contextmanager
def interrupts_not_lost():
    """Ctrl-C inside the block ends it with KeyboardInterrupt, even if code in it catches and
    drops the KeyboardInterrupt (seen while the model loads: an interrupt early in the load was
    lost and the chat went on to answer): the signal is also recorded and raised again when the
    block returns; a second Ctrl-C quits at once. Main thread only (where Python handles
    signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit = False

    def handler(signum, frame):
        nonlocal hit
        if hit:                              # pressed again: something kept going; quit now
            print("", file=sys.stderr, flush=True)
            os._exit(130)
        hit = True
        print("\n(interrupting; press Ctrl-C again to quit at once)", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except (ValueError, OSError):            # no signals here (embedded interpreter)
        yield
        return
    if previous is signal.SIG_IGN:           # started with Ctrl-C ignored (nohup, &): keep it
        signal.signal(signal.SIGINT, previous)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if hit:
        raise KeyboardInterrupt


def _checked_text(text: str | None, what: str) -> str | None:
    """``text`` with bytes that are not UTF-8 replaced by U+FFFD; says so on stderr."""
    if text is None:
        return None
    text, replaced = valid_text(text)
    if replaced:
        print(f"note: {what} had bytes that are not valid UTF-8; they were replaced by \ufffd.",
              file=sys.stderr)
    return text


def run(args) -> int:
    params = _params(args)
    system = _checked_text(args.system, "the system prompt")
    prompt = _checked_text(args.prompt, "the prompt")
    cfg = config_from(args)
    # Everything that can be checked without the model, before minutes of loading it.
    if prompt is not None:
        check_message(prompt)
    if cfg.max_seq_len is not None:
        check_room(cfg.max_seq_len, cfg.max_seq_len, params.max_new_tokens)
    if not args.json:
        print("loading model...", file=sys.stderr)
    from qwen_trt.serving.service import start_service_for

    service = None
    try:
        with interrupts_not_lost():
            service = start_service_for(cfg)  # the engine process, or an OpenAI-compatible server
        return _serve(args, service, params, system, prompt)
    finally:
        if service is not None:
            service.close()


def _serve(args, service, params: SamplingParams, system: str | None, prompt: str | None) -> int:
    session = ChatSession(service.tokenizer, system_prompt=system)
    if prompt is not None:
        reply_once(service, session, prompt, params, as_json=args.json)
        return 0
    print(f"{service.info.describe()}\n{HELP}", file=sys.stderr)
    if hasattr(sys.stdin, "reconfigure"):   # undecodable bytes arrive as surrogates, not errors
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            print("\n> ", end="", file=sys.stderr, flush=True)  # stdout stays pure reply text/JSON
            text = _checked_text(input(), "that message")
        except EOFError:
            return 0
        except KeyboardInterrupt:
            return 130
        cmd = text.strip()
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/clear":
            session.clear()
            print("(conversation cleared)", file=sys.stderr)
            continue
        try:
            reply_once(service, session, text, params, as_json=args.json)
        except QwenTrtError as e:  # bad input: say so and keep the conversation
            print(f"error: {e}", file=sys.stderr)
        except Exception as e:     # a bug: one line (details with -v logging), chat kept
            logging.getLogger(__name__).debug("reply failed", exc_info=True)
            print(f"error: {user_error(e)}", file=sys.stderr)
