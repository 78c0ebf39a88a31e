"""``qwen-trt`` command line. Each subcommand lives in ``qwen_trt/commands/<name>.py`` and
exposes ``register(subparsers)``; errors the user can fix print one line, never a traceback."""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from qwen_trt import settings
from qwen_trt.debug import debug_enabled, enable_debug
from qwen_trt.errors import QwenTrtError

# One module per subcommand; add a line here when a new one lands.
COMMAND_MODULES = (
    "qwen_trt.commands.chat",
    "qwen_trt.commands.tiny",
    "qwen_trt.commands.bench",
    "qwen_trt.commands.build",
    "qwen_trt.commands.export_onnx",
    "qwen_trt.commands.serve",
    "qwen_trt.commands.quantize",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen-trt",
        description="Low-latency chat with Qwen3-4B-Instruct-2507 (TensorRT-LLM or PyTorch).")
    parser.add_argument("--debug", action="store_true",
                        help=settings.declared("QWEN_TRT_DEBUG").help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings.warn_unknown()
    if args.debug:
        enable_debug()                 # the engine process inherits it
    debug = debug_enabled()
    try:
        return int(args.func(args) or 0)
    except QwenTrtError as e:
        if debug:
            traceback.print_exc()
        print(f"qwen-trt: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a bug or an environment problem: still one line
        if debug:
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:300]
        detail = f"{type(e).__name__}: {first}" if first else type(e).__name__
        hint = "" if debug else "; run with --debug (or QWEN_TRT_DEBUG=1) for the traceback"
        print(f"qwen-trt: error: unexpected error ({detail}){hint}.", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
