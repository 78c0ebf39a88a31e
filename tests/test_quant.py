"""Weight formats on CPU (CI): FP8 block / INT4 group packing and the AWQ/GPTQ layouts,
``qwen-trt quantize`` checkpoints and ``--quantization`` at load on the tiny model, numerics
against the same weights dequantized, and the one-line format errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from qwen_trt.cli import main
from qwen_trt.errors import ModelSourceError
from qwen_trt.fast import FastConfig, FastDecoder, build_model, load_fast_decoder
from qwen_trt.fast.model.qformats import AWQ_ORDER, FP8_MAX, Fp8Linear, Int4Linear, QuantSpec, fp8_quantize, from_awq, from_gptq, pack_rows, quantize, to_awq, to_gptq
from qwen_trt.fast.kernels.linear import dense
from qwen_trt.params import SamplingParams

PROJ = ("wqkv", "wo", "w_gate_up", "w_down")
PROMPT = [5, 17, 99, 3, 250, 41, 7, 7, 300, 12]


def _cfg(folder) -> FastConfig:
    return FastConfig.from_hf(json.loads((folder / "config.json").read_text()))


def _load(folder, quantization="auto", cfg_from=None):
    return load_fast_decoder(_cfg(cfg_from or folder), weights=folder, max_seq_len=256,
                             dtype=torch.float32, device="cpu", warmup=False,
                             quantization=quantization)


def _dense_copy(model):
    """A dense model with ``model``'s packed projections dequantized."""
    ref = build_model(model.cfg, max_seq_len=model.max_seq_len, dtype=model.dtype, device="cpu")
    src = dict(model.named_buffers())
    with torch.no_grad():
        for name, b in ref.named_buffers():
            if name.startswith(("cache.", "cos", "sin")):
                continue
            parts = name.split(".")
            if parts[0] == "layers" and parts[2] in PROJ:
                b.copy_(dense(getattr(model.layers[int(parts[1])], parts[2]), model.dtype))
            else:
                b.copy_(src[name])
    return ref


def _weights(model):
    return [dense(getattr(layer, n), torch.float32) for layer in model.layers for n in PROJ]


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint written by ``qwen-trt quantize`` in each format."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, args in (("fp8", ["--fp8"]), ("awq", ["--int4-rtn"]),
                       ("gptq", ["--int4-rtn", "--layout", "gptq"])):
        assert main(["quantize", *args, str(tiny_model_dir), str(root / name)]) == 0
        out[name] = root / name
    return out


def test_fp8_blocks_scale_each_block_to_the_fp8_range():
    torch.manual_seed(0)
    w = torch.randn(300, 200)
    q, s = fp8_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    # each 128x128 block's largest magnitude maps to the top of the e4m3 range
    blocks = q.float().abs()
    assert blocks[:128, :128].max() == FP8_MAX and blocks[256:, 128:].max() == FP8_MAX
    back = Fp8Linear(q, s, (128, 128)).dequantize(torch.float32)
    assert ((back - w).norm() / w.norm()).item() < 0.04      # e4m3: 3 mantissa bits


def test_int4_layouts_pack_the_documented_nibble_order():
    vals = torch.arange(16, dtype=torch.int32).repeat(16, 8)[:, :128]      # q[n, k] = k % 16
    w = Int4Linear(pack_rows(vals), torch.ones(16, 1), torch.zeros(16, 1, dtype=torch.uint8), 128)
    assert torch.equal(w.unpacked(), vals)
    assert w.qweight[0, 0].item() == 0x76543210                 # column 8j+i in bits 4i
    awq = to_awq(w)      # [K, N/8] packed along N: q[k, n] = k % 16, so one word per k
    assert awq["qweight"].shape == (128, 2) and awq["qweight"][3, 0].item() == 0x33333333
    wt = Int4Linear(pack_rows(vals.t().contiguous()[:16, :16].repeat(1, 8)), torch.ones(16, 1),
                    torch.zeros(16, 1, dtype=torch.uint8), 128)   # q[n, k] = n % 16
    word = to_awq(wt)["qweight"][0, 0].item()
    assert word == sum(c << (4 * i) for i, c in enumerate(AWQ_ORDER))      # AWQ's interleave
    gptq = to_gptq(Int4Linear(w.qweight, w.scales, w.zeros + 1, 128))
    assert gptq["qweight"].shape == (16, 16) and gptq["qweight"][0, 0].item() == 0x76543210


def test_awq_and_gptq_round_trip_exactly():
    torch.manual_seed(1)
    w = quantize(torch.randn(64, 256) * 0.05, QuantSpec("int4", group=128))
    a = from_awq(**{k: v for k, v in to_awq(w).items()}, group=128)
    g = to_gptq(w)
    b = from_gptq(g["qweight"], g["qzeros"], g["scales"], 128)
    for other in (a, b):
        assert torch.equal(other.qweight, w.qweight) and torch.equal(other.zeros, w.zeros)
        assert torch.equal(other.dequantize(torch.float32), w.dequantize(torch.float32))


def test_quantized_checkpoints_load_packed_and_equal_quantizing_at_load(tiny_model_dir,
                                                                         quantized):
    cfgs = {n: json.loads((p / "config.json").read_text())["quantization_config"]
            for n, p in quantized.items()}
    assert cfgs["fp8"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}
    assert cfgs["awq"]["version"] == "gemm" and cfgs["gptq"]["desc_act"] is False
    from safetensors import safe_open
    with safe_open(str(quantized["fp8"] / "model.safetensors"), "pt") as h:
        s = h.get_tensor("model.layers.0.self_attn.q_proj.weight_scale_inv")
        assert s.dtype == torch.bfloat16 and s.shape == (1, 1)
        assert h.get_tensor("model.embed_tokens.weight").dtype != torch.float8_e4m3fn
    dense_bytes = _load(tiny_model_dir).model.weight_bytes
    fp8 = _load(quantized["fp8"]).model
    with safe_open(str(quantized["fp8"] / "model.safetensors"), "pt") as h:   # fused == parts
        parts = [h.get_tensor(f"model.layers.1.self_attn.{p}_proj.weight").float()
                 * h.get_tensor(f"model.layers.1.self_attn.{p}_proj.weight_scale_inv").float()
                 for p in "qkv"]          # one block per part in the tiny model
    assert torch.equal(dense(fp8.layers[1].wqkv, torch.float32), torch.cat(parts))
    assert isinstance(fp8.layers[0].wqkv, Fp8Linear) and fp8.weight_bytes < dense_bytes
    at_load = _load(tiny_model_dir, "fp8").model
    assert all(torch.equal(a, b) for a, b in zip(_weights(fp8), _weights(at_load)))
    awq, gptq = _load(quantized["awq"]).model, _load(quantized["gptq"]).model
    int4 = _load(tiny_model_dir, "int4").model
    assert isinstance(awq.layers[1].w_down, Int4Linear) and awq.weight_bytes < fp8.weight_bytes
    for other in (gptq, int4):
        assert all(torch.equal(a, b) for a, b in zip(_weights(awq), _weights(other)))
    # packed -> none: the same numbers, dense
    plain = _load(quantized["fp8"], "none").model
    assert isinstance(plain.layers[0].wqkv, torch.Tensor)
    assert all(torch.equal(a, b) for a, b in zip(_weights(plain), _weights(fp8)))


@pytest.mark.parametrize("fmt", ["fp8", "awq"])
def test_packed_model_logits_and_greedy_tokens_equal_the_dequantized_model(quantized, fmt):
    model = _load(quantized[fmt]).model
    ref = _dense_copy(model)
    ids, last = torch.tensor(PROMPT), torch.tensor([len(PROMPT) - 1])
    with torch.inference_mode():
        a, b = model.prefill(ids, last), ref.prefill(ids, last)
        assert torch.allclose(a, b, atol=1e-5)
        kv = torch.arange(256)
        tok, pos = torch.tensor([7]), torch.tensor([len(PROMPT)])
        assert torch.allclose(model.decode(tok, pos, kv), ref.decode(tok, pos, kv), atol=1e-5)
    p = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    got = list(FastDecoder(model, compile=False).generate(PROMPT, p))
    assert got == list(FastDecoder(ref, compile=False).generate(PROMPT, p))


def test_batched_step_with_packed_weights_equals_the_dequantized_model(quantized):
    from qwen_trt.fast.step.batched import SeqChunk
    from qwen_trt.fast.step.build import make_batched

    model = _load(quantized["gptq"]).model
    ref = _dense_copy(model)
    outs = []
    for m in (model, ref):
        bm = make_batched(m, kv_tokens=1024, warmup=False)
        chunks = [SeqChunk(0, 6, 6, (1,)), SeqChunk(6, 4, 4, (2,))]
        outs.append(bm.forward(PROMPT, list(range(6)) + list(range(4)), chunks, [5, 9]))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    p = folder / "config.json"
    hf = json.loads(p.read_text())
    hf["quantization_config"].update(changes)
    p.write_text(json.dumps(hf))


def _edit_tensors(folder, fn):
    from safetensors.torch import load_file, save_file
    f = folder / "model.safetensors"
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f), metadata={"format": "pt"})


def _error(folder, cfg_from) -> str:
    with pytest.raises(ModelSourceError) as e:
        _load(folder, cfg_from=cfg_from)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_format_errors_are_one_line_naming_the_file(tiny_model_dir, quantized, tmp_path):
    q = "model.layers.0.self_attn.q_proj"
    d = _copy(quantized["fp8"], tmp_path / "noscale")
    _edit_tensors(d, lambda s: s.pop(q + ".weight_scale_inv"))
    msg = _error(d, tiny_model_dir)
    assert "model.safetensors" in msg and "weight_scale_inv" in msg and q in msg

    d = _copy(quantized["fp8"], tmp_path / "block64")
    _edit_config(d, weight_block_size=[64, 64])
    msg = _error(d, tiny_model_dir)
    assert "config.json" in msg and "[64, 64]" in msg

    d = _copy(quantized["fp8"], tmp_path / "scales64")      # scales of 64x64 blocks
    _edit_tensors(d, lambda s: s.__setitem__(q + ".weight_scale_inv",
                                             torch.ones(2, 1, dtype=torch.bfloat16)))
    msg = _error(d, tiny_model_dir)
    assert "model.safetensors" in msg and "wrong block size" in msg

    d = _copy(quantized["fp8"], tmp_path / "pertensor")
    _edit_config(d, weight_block_size=None)
    assert "per-tensor" in _error(d, tiny_model_dir)

    d = _copy(quantized["gptq"], tmp_path / "actorder")
    _edit_config(d, desc_act=True)
    msg = _error(d, tiny_model_dir)
    assert "config.json" in msg and "act-order" in msg

    d = _copy(quantized["gptq"], tmp_path / "gidx")      # act-order in g_idx (down: 2 groups)
    down = "model.layers.1.mlp.down_proj.g_idx"
    _edit_tensors(d, lambda s: s.__setitem__(down, s[down].flip(0)))
    msg = _error(d, tiny_model_dir)
    assert "model.safetensors" in msg and down in msg and "act-order" in msg

    d = _copy(quantized["awq"], tmp_path / "noscales")
    _edit_tensors(d, lambda s: s.pop(q + ".scales"))
    assert q + ".scales" in _error(d, tiny_model_dir)

    with pytest.raises(ModelSourceError, match="quantize it twice"):
        _load(quantized["fp8"], "int4")


def test_quantize_command_refuses_a_quantized_source_in_one_line(quantized, tmp_path, capsys):
    assert main(["quantize", "--fp8", str(quantized["fp8"]), str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err.strip()
    assert "already quantized" in err and len(err.splitlines()) == 1


def test_fp8_without_tensor_cores_says_so_and_refuses_tensorcore_prefill(quantized,
                                                                         tiny_model_dir):
    from qwen_trt.fast.options import KernelOptions, use

    # the variables, read once into the kernel options
    env = {"QWEN_TRT_FP8_TENSOR_CORES": "0"}
    with use(KernelOptions.from_env(env)):
        dec = _load(quantized["fp8"])
        assert any("without FP8 tensor cores: W8A16 kernels" in n for n in dec.stats.notes)
    with use(KernelOptions.from_env({**env, "QWEN_TRT_FP8_PREFILL": "tensorcore"})):
        msg = _error(quantized["fp8"], tiny_model_dir)
        assert "FP8 tensor-core prefill needs FP8 tensor cores" in msg
    with use(KernelOptions.from_env(env)):
        assert _load(tiny_model_dir).stats.notes == []        # bf16 weights never get the note


def test_bench_measures_each_weight_format_as_its_own_path():
    from qwen_trt.bench import BenchConfig, run_bench

    cfg = BenchConfig(random_weights=True, shape="tiny", device="cpu", prompt_lens=(8,),
                      new_tokens=4, repeats=1, slow_repeats=1, paths=("fast",),
                      quantization=("none", "fp8", "int4"))
    out = run_bench(cfg, log=lambda m: None)
    paths = out["paths"]
    assert {k: v["status"] for k, v in paths.items()} == {
        "fast": "ok", "fast:fp8": "ok", "fast:int4": "ok"}
    assert [paths[k]["quantization"] for k in ("fast", "fast:fp8", "fast:int4")] == [
        "none", "fp8", "int4"]
    assert paths["fast:int4"]["weights_GB"] <= paths["fast:fp8"]["weights_GB"]
    assert {r["path"] for r in out["rows"]} == {"fast", "fast:fp8", "fast:int4"}


def test_quantization_needs_the_fast_path(tiny_model_dir):
    from qwen_trt.backends import BackendConfig, load_backend
    from qwen_trt.errors import ConfigError

    with pytest.raises(ConfigError, match="needs the fast path"):
        load_backend(BackendConfig(model=str(tiny_model_dir), device="cpu", fast="off",
                                   quantization="fp8"))
    backend = load_backend(BackendConfig(model=str(tiny_model_dir), device="cpu", fast="on",
                                         quantization="fp8", warmup=False))
    assert isinstance(backend.decoder.model.layers[0].wqkv, Fp8Linear)


def _blockwise_scaled_mm_emulated(a, b, scale_a, scale_b, out_dtype):
    """torch._scaled_mm's block-wise recipe (1x128 activations, 128x128 weights) on CPU, with
    the layouts cuBLAS requires asserted (what fp8_scaled_linear must hand it)."""
    m, k = a.shape
    n = b.shape[1]
    assert a.dtype == b.dtype == torch.float8_e4m3fn and m % 4 == 0
    assert b.stride() == (1, k), "b must be column-major (the weights' [N, K] transposed)"
    assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m), scale_a.stride()
    # the weight scales' transpose [N/128, K/128] row-major, rows 16-byte aligned
    assert scale_b.dtype == torch.float32 and scale_b.shape == (k // 128, n // 128)
    assert scale_b.stride() == (1, k // 128) and (k // 128) % 4 == 0, scale_b.stride()
    sa = scale_a.float().repeat_interleave(128, 1)
    sb = scale_b.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)


@pytest.mark.parametrize("rows,k", [(37, 512), (64, 1536), (1, 2560)])
def test_fp8_tensor_core_linear_hands_cublas_its_layouts_and_matches_dequantized(
        monkeypatch, rows, k):
    """The FP8 tensor-core prefill's wrapper: activations quantized per row and 128 columns,
    rows padded to a multiple of 4 and cut back, the scales in the strides cuBLAS's
    block-scaled GEMM takes (asserted by the emulation), and the product within FP8's
    activation rounding of the dequantized weights; K not a multiple of 512 stays on the
    dequantizing prefill (its scale rows would not be 16-byte aligned)."""
    from qwen_trt.fast.model.qformats import Fp8Linear, fp8_act_quant, fp8_quantize, fp8_tensor_core_ok
    from qwen_trt.fast.kernels.linear import FP8_TC_MIN_ROWS, fp8_scaled_linear, linear

    assert not fp8_tensor_core_ok(Fp8Linear(*fp8_quantize(torch.randn(256, 384)), (128, 128)))

    monkeypatch.setattr(torch, "_scaled_mm", _blockwise_scaled_mm_emulated)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(256, k, generator=g) * 0.02
    lin = Fp8Linear(*fp8_quantize(w), (128, 128))
    x = torch.randn(2, rows, k, generator=g).to(torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), lin.dequantize(torch.float32))
    got = fp8_scaled_linear(x, lin)
    assert got.shape == (2, rows, 256) and got.dtype == torch.bfloat16
    err = ((got.float() - ref).norm() / ref.norm()).item()
    assert 1e-4 < err < 0.05, err                 # FP8 activations: not exact, but close
    lin.tensor_cores = True                       # the prefill's dispatch: from 16 rows
    if 2 * rows >= FP8_TC_MIN_ROWS:
        assert torch.equal(linear(x, lin), got)
    else:                                         # fewer (a decode): bf16 activations
        assert torch.equal(linear(x, lin),
                           torch.nn.functional.linear(x, lin.dequantize(x.dtype)))
    q, s = fp8_act_quant(x.reshape(-1, k))
    back = q.float().view(-1, k // 128, 128) * s.unsqueeze(-1)
    assert ((back.view(-1, k) - x.reshape(-1, k).float()).abs().max() <=
            x.float().abs().max() * 2 ** -4)
    assert torch.equal(fp8_act_quant(torch.zeros(4, 128))[0].float(), torch.zeros(4, 128))


def test_fp8_prefill_setup_marks_weights_only_on_hopper_after_its_check(quantized,
                                                                        monkeypatch):
    """setup_fp8_prefill: nothing on CPU or with QWEN_TRT_FP8_PREFILL=dequant; with tensorcore
    or auto (the default) on a (pretended) H200 whose check passes, every FP8 projection the
    recipe fits is marked; a failed check or a GPU other than Hopper is a one-line error with
    tensorcore, the dequantizing prefill (with a note for the check) with auto."""
    from qwen_trt.fast import loader
    from qwen_trt.fast.model.qformats import Fp8Linear, fp8_quantize

    dec = _load(quantized["fp8"])
    model = dec.model
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert fp8 and loader.setup_fp8_prefill(model) == []          # CPU: nothing
    assert not model.fp8_tensor_core_prefill
    monkeypatch.setattr(loader, "fp8_tensor_cores", lambda d: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    assert loader.setup_fp8_prefill(model, "dequant") == []
    assert not model.fp8_tensor_core_prefill
    monkeypatch.setattr(loader, "check_fp8_prefill", lambda d: "fp8 tensor-core prefill "
                                                               "unavailable (X: y)")
    with pytest.raises(ModelSourceError, match="unavailable"):
        loader.setup_fp8_prefill(model, "tensorcore")
    # auto (the default): the failed check is a note, and the dequantizing prefill
    assert loader.setup_fp8_prefill(model, "auto") == [
        "fp8 tensor-core prefill unavailable (X: y); prefill dequantizes then runs bf16 GEMMs"]
    assert not model.fp8_tensor_core_prefill
    monkeypatch.setattr(loader, "check_fp8_prefill", lambda d: None)
    # the tiny model's 64-wide projections do not fit the recipe: none marked, said so
    assert loader.setup_fp8_prefill(model, "tensorcore") == [
        f"fp8 tensor-core prefill for 0 of {len(fp8)} projections (the rest: N not a "
        "multiple of 128 or K not of 512)"]
    assert not model.fp8_tensor_core_prefill

    class Two(torch.nn.Module):                    # one aligned projection, one not
        device = torch.device("cpu")

        def __init__(self):
            super().__init__()
            self.a = Fp8Linear(*fp8_quantize(torch.randn(256, 512)), (128, 128))
            self.b = Fp8Linear(*fp8_quantize(torch.randn(256, 200)), (128, 128))
    two = Two()
    assert loader.setup_fp8_prefill(two, "tensorcore") == [
        "fp8 tensor-core prefill for 1 of 2 projections (the rest: N not a multiple of 128 "
        "or K not of 512)"]
    assert two.a.tensor_cores and not two.b.tensor_cores
    two.a.tensor_cores = False
    assert loader.setup_fp8_prefill(two, "auto") == [     # auto marks as tensorcore does
        "fp8 tensor-core prefill for 1 of 2 projections (the rest: N not a multiple of 128 "
        "or K not of 512)"]
    assert two.a.tensor_cores and not two.b.tensor_cores
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 9))
    assert loader.setup_fp8_prefill(model, "auto") == []  # not Hopper: auto dequantizes
    with pytest.raises(ModelSourceError, match="Hopper"):
        loader.setup_fp8_prefill(model, "tensorcore")


def test_batched_steps_use_fp8_tensor_cores_only_when_asked():
    """The batched runner's steps that prefill take FP8 weights marked for tensor cores as they
    are only with QWEN_TRT_FP8_PREFILL=tensorcore (and Triton pieces); under auto, the default,
    they dequantize (measured slower on tensor cores on the H200), as with dequant."""
    from types import SimpleNamespace

    from qwen_trt.fast.step import batched
    from qwen_trt.fast.options import KernelOptions, use
    from qwen_trt.fast.kernels.linear import dense, prefill_weight

    step = SimpleNamespace(_pre=batched._pre_triton)
    for mode, want in (("tensorcore", prefill_weight), ("auto", dense), ("dequant", dense)):
        with use(KernelOptions(fp8_prefill=mode)):
            assert batched.BatchedModel._step_weight(step) is want, mode
    with use(KernelOptions(fp8_prefill="tensorcore")):
        step_compiled = SimpleNamespace(_pre=object())     # pieces compiled by torch.compile
        assert batched.BatchedModel._step_weight(step_compiled) is dense
