"""``qwen-trt build --gpu a10 [--model M]``: build the TensorRT-LLM engine for one GPU profile
(what ``make engine GPU=a10`` runs). See :mod:`qwen_trt.engine.build` for the stages."""
from __future__ import annotations

from pathlib import Path

from qwen_trt import settings


def register(sub) -> None:
    p = sub.add_parser("build", help="build the TensorRT-LLM engine (FP16; BF16 with --dtype; FP8 / "
                                     "INT4 / INT8 with --quant) for a GPU profile")
    p.add_argument("--gpu", default=None,
                   help="profile name in build/profiles/ (a10, a10g, l4, a100, h100, h200, "
                        "rtx4090) or a path to a .toml profile")
    p.add_argument("--model", default=None,
                   help="checkpoint folder or hub id (default: $QWEN_TRT_MODEL or "
                        f"{settings.declared('QWEN_TRT_MODEL').default})")
    p.add_argument("--out-dir", default="build/out", help="work folder (TensorRT-LLM checkpoint)")
    p.add_argument("--engines-dir", default=settings.get("QWEN_TRT_ENGINES_DIR"),
                   help=settings.declared("QWEN_TRT_ENGINES_DIR").help)
    p.add_argument("--profiles-dir", default=None, help="folder of <gpu>.toml profiles")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default=None,
                   help="engine dtype (default: the profile's, float16); bfloat16 needs an "
                        "Ampere or newer GPU and goes to engines/<gpu>-bf16/")
    p.add_argument("--quant", choices=("fp8", "int4_awq", "int8_wo", "int4_wo"), default=None,
                   help="quantized engine in engines/<gpu>-<quant>/: fp8 (sm89+: L4, RTX 4090, "
                        "H100, H200; ModelOpt, calibrated on cnn_dailymail), int4_awq (ModelOpt "
                        "AWQ, calibrated), int8_wo / int4_wo (weight-only, no calibration); "
                        "default: none (the FP16 engine)")
    p.add_argument("--force", action="store_true", help="rerun every stage")
    p.add_argument("--list", action="store_true", help="list the profiles and exit")
    p.set_defaults(func=run)


def list_profiles(profiles_dir: Path | None) -> int:
    from qwen_trt.engine.profiles import load_all
    from qwen_trt.engine.quant import others_for

    print(f"{'profile':<9} {'sm':<5} {'GiB':>4} {'batch':>5} {'max_seq_len':>11} "
          f"{'max_input_len':>13} {'max_num_tokens':>14}  {'--quant':<30}  description")
    for pr in load_all(profiles_dir):
        b = pr.build
        cc = tuple(int(x) for x in pr.gpu.compute_capability.split("."))
        quants = ",".join(others_for(cc))
        print(f"{pr.name:<9} {pr.gpu.sm:<5} {pr.gpu.memory_gib:>4.0f} {b.max_batch_size:>5} "
              f"{b.max_seq_len:>11} {b.max_input_len:>13} {b.max_num_tokens:>14}  {quants:<30}  "
              f"{pr.description}")
    return 0


def run(args) -> int:
    from qwen_trt.engine.build import BuildRequest, run_build
    from qwen_trt.errors import QwenTrtError

    profiles_dir = Path(args.profiles_dir) if args.profiles_dir else None
    if args.list:
        return list_profiles(profiles_dir)
    if not args.gpu:
        raise QwenTrtError("Say which GPU profile to build: --gpu a10 (see `qwen-trt build --list`).")
    result = run_build(BuildRequest(gpu=args.gpu, model=args.model, out_dir=Path(args.out_dir),
                                    engines_dir=Path(args.engines_dir), profiles_dir=profiles_dir,
                                    force=args.force, dtype=args.dtype, quant=args.quant))
    print(result.engine_dir)
    return 0
