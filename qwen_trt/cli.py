"""``qwen-trt`` command line. Each subcommand lives in ``qwen_trt/commands/<name>.py`` and
exposes ``register(subparsers)``; errors the user can fix print one line, never a traceback."""
from __future__ import annotations

import argparse
import importlib
import sys

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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except QwenTrtError as e:
        print(f"qwen-trt: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
