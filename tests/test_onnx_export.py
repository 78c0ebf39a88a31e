"""ONNX export of the tiny Qwen3 checkpoint, checked against ONNX Runtime (CPU).

The float32 export runs once per module (fixture ``exported``); each test reads it.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from qwen_trt.onnx import export as ox  # noqa: E402
from qwen_trt.onnx import runtime_check as rc  # noqa: E402
from qwen_trt.cli import main  # noqa: E402
from qwen_trt.onnx.pipeline import run_pipeline  # noqa: E402
from qwen_trt.errors import ModelSourceError, QwenTrtError  # noqa: E402
from qwen_trt.model.source import resolve_model  # noqa: E402
from qwen_trt.params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def exported(tiny_model_dir, tmp_path_factory):
    lines: list[str] = []
    out = tmp_path_factory.mktemp("onnx") / "onnx"
    summary = run_pipeline(str(tiny_model_dir), out, dtype="float32", write=lines.append)
    return summary, lines


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return ox.load_torch_model(resolve_model(str(tiny_model_dir)), "float32")


@pytest.fixture(scope="module")
def decoder(exported):
    summary, _ = exported
    return rc.OrtDecoder(summary.out_dir / ox.MODEL_FILE)


@pytest.fixture(scope="module")
def prompt_ids(tiny_tokenizer):
    return rc.default_prompt_ids(tiny_tokenizer)


# --------------------------------------------------------------------------- export + check


def test_export_writes_model_and_manifest(exported, tiny_model_dir):
    import onnx
    import torch

    summary, _ = exported
    out = summary.out_dir
    assert (out / "model.onnx").is_file()
    assert not (out / "model.onnx.data").exists()  # 0.5 MB of weights stay inline
    assert not list(out.parent.glob(".*partial*"))  # staging folder was moved into place
    m = ox.read_manifest(out)
    assert m == json.loads((out / "manifest.json").read_text())
    assert m["format"] == ox.MANIFEST_FORMAT
    assert m["model_file"] == "model.onnx" and m["data_files"] == []
    assert m["dtype"] == "float32"
    assert m["opset"] == ox.DEFAULT_OPSET
    assert "dynamo=True" in m["exporter"]
    assert m["versions"]["torch"] == torch.__version__
    assert m["versions"]["onnx"] == onnx.__version__
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert m["model_config"]["num_layers"] == cfg["num_hidden_layers"]
    assert m["model_config"]["num_kv_heads"] == cfg["num_key_value_heads"]
    assert m["model_config"]["head_dim"] == cfg["head_dim"]
    assert [f["name"] for f in m["source"]["hashed_files"]] == ["config.json",
                                                                "model.safetensors"]
    assert len(m["source"]["sha256"]) == 64
    layers = cfg["num_hidden_layers"]
    assert [i["name"] for i in m["inputs"]] == ox.input_names(layers)
    assert [o["name"] for o in m["outputs"]] == ox.output_names(layers)
    by_name = {t["name"]: t for t in m["inputs"] + m["outputs"]}
    assert by_name["input_ids"] == {"name": "input_ids", "dtype": "int64",
                                    "shape": ["batch", "seq"]}
    past = by_name["past_key_0"]["shape"]
    assert past[0] == "batch" and isinstance(past[2], str)
    assert past[1] == cfg["num_key_value_heads"] and past[3] == cfg["head_dim"]
    present = by_name["present_value_1"]["shape"]
    assert isinstance(present[2], str) and present[2] != past[2]  # past + seq
    assert by_name["logits"]["shape"] == ["batch", "seq", cfg["vocab_size"]]
    assert m["verify"]["ok"] is True
    assert m["verify"]["max_abs_diff"] < rc.TOLERANCE["float32"]


def test_checker_and_shape_inference_pass(exported):
    import onnx

    summary, _ = exported
    path = str(summary.out_dir / "model.onnx")
    onnx.checker.check_model(path, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(onnx.load(path), strict_mode=True)
    assert len(inferred.graph.node) == summary.check.nodes


def test_check_model_rejects_wrong_signature(exported):
    summary, _ = exported
    mc = summary.manifest.model_config
    real = ox.DecoderShape(mc["num_layers"], mc["num_kv_heads"], mc["head_dim"], mc["vocab_size"])
    ox.check_model(summary.out_dir / "model.onnx", real, "float32")  # the right one passes
    wrong = ox.DecoderShape(real.num_layers, real.num_kv_heads + 1, real.head_dim,
                            real.vocab_size)
    with pytest.raises(ox.OnnxExportError, match="KV tensors"):
        ox.check_model(summary.out_dir / "model.onnx", wrong, "float32")
    with pytest.raises(ox.OnnxExportError, match="inputs"):
        ox.check_model(summary.out_dir / "model.onnx",
                       ox.DecoderShape(real.num_layers + 1, real.num_kv_heads, real.head_dim,
                                       real.vocab_size), "float32")


def test_source_fingerprint_covers_config_and_weights(tiny_model_dir, tmp_path):
    copy = Path(shutil.copytree(tiny_model_dir, tmp_path / "copy"))
    base, _ = ox.source_fingerprint(copy)
    assert base == ox.source_fingerprint(tiny_model_dir)[0]
    (copy / "README.md").write_text("not hashed")
    assert ox.source_fingerprint(copy)[0] == base
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(cfg))
    changed_cfg, _ = ox.source_fingerprint(copy)
    assert changed_cfg != base
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert ox.source_fingerprint(copy)[0] not in (base, changed_cfg)


def test_progress_shows_every_stage_with_timings(exported):
    _, lines = exported
    text = "\n".join(lines)
    for n, stage in enumerate(("load", "export", "check", "manifest", "verify"), start=1):
        assert f"[{n}/5] {stage}" in text
    assert text.count(" s\n") + text.endswith(" s") >= 5  # "done in 1.2 s" after each stage
    assert "identical to HF generate" in text


# --------------------------------------------------------------------------- parity


def test_logits_parity_prefill_and_decode_steps(decoder, hf_model, prompt_ids):
    diffs = rc.compare_decode_logits(decoder, hf_model, prompt_ids, decode_steps=6)
    assert [d.step for d in diffs][0].startswith("prefill")
    assert len(diffs) == 7
    for d in diffs:
        assert d.ref_max_abs > 0.1  # real logits, not zeros
        assert d.max_abs_diff <= rc.TOLERANCE["float32"] * max(1.0, d.ref_max_abs), d


@pytest.mark.parametrize("length", [1, 600])
def test_logits_parity_single_token_and_long_prompts(decoder, hf_model, length):
    """No axis is specialised to the example sizes used at export (batch 2, seq 5, past 3)."""
    prompt = [(7 * i + 3) % 500 for i in range(length)]
    for d in rc.compare_decode_logits(decoder, hf_model, prompt, decode_steps=2):
        assert d.ratio() <= rc.TOLERANCE["float32"], d


def test_parity_check_detects_a_wrong_cache(decoder, hf_model, prompt_ids):
    """The comparison can fail: a decode step over a zeroed cache is far from torch."""
    import numpy as np
    import torch

    pre = decoder.step(prompt_ids, decoder.empty_past(1), 0)
    tok = int(pre.logits[0, -1].argmax())
    zeroed = [np.zeros_like(p) for p in pre.present]
    bad = decoder.step([tok], zeroed, len(prompt_ids))
    with torch.inference_mode():
        ref = hf_model(input_ids=torch.tensor([list(prompt_ids) + [tok]])).logits[:, -1:]
    diff = rc._diff("zeroed cache", bad.logits, ref)
    assert diff.ratio() > rc.TOLERANCE["float32"] * 100


def test_padded_batch_parity(decoder, hf_model, prompt_ids):
    d = rc.compare_padded_batch(decoder, hf_model, [prompt_ids, prompt_ids[:7], prompt_ids[3:20]],
                                pad_id=0)
    assert d.ratio() <= rc.TOLERANCE["float32"]


GREEDY_TEXTS = ("The quick brown fox jumps over the lazy dog.", "def fibonacci(n):\n    if n < 2:",
                "你好，世界！今天天气很好。", "Numbers: 0 1 2 3", "A low-latency chat service")


def test_greedy_parity_with_torch_backend(decoder, tiny_backend, tiny_tokenizer):
    n = 24
    seen: set[int] = set()
    for text in GREEDY_TEXTS:
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        onnx_tokens = decoder.greedy(ids, n)  # no stop tokens: exactly n
        backend_tokens = list(tiny_backend.stream(
            ids, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)))
        assert len(onnx_tokens) == n
        assert onnx_tokens == backend_tokens, text
        seen.update(onnx_tokens)
    # The random tiny model soon repeats itself; across prompts the tokens still vary.
    assert len(seen) >= 5


def test_greedy_parity_with_hf_generate(decoder, hf_model, prompt_ids):
    stop = rc.stop_ids_of(hf_model)
    assert stop  # <|im_end|>, <|endoftext|>
    onnx_tokens = decoder.greedy(prompt_ids, 32, stop)
    assert onnx_tokens == rc.torch_greedy(hf_model, prompt_ids, 32, stop, pad_id=None)


def test_verify_fails_against_a_different_model(decoder, tiny_model_dir, prompt_ids):
    import torch

    other = ox.load_torch_model(resolve_model(str(tiny_model_dir)), "float32")
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(1.05)
    report = rc.verify_export("unused", other, prompt_ids, dtype="float32", decoder=decoder)
    assert not report.logits_ok and not report.ok
    assert any("FAIL" in line for line in report.summary())


# --------------------------------------------------------------------------- fp16


def test_float16_export_runs_in_onnxruntime(tiny_model_dir, tmp_path, prompt_ids):
    from onnx import TensorProto, load

    out = tmp_path / "onnx16"
    summary = run_pipeline(str(tiny_model_dir), out, dtype="float16", verify=False,
                           external_data="always", write=lambda _: None)
    assert (out / "model.onnx.data").is_file()  # external data forced
    assert summary.manifest.data_files == ["model.onnx.data"]
    assert summary.manifest.dtype == "float16"
    proto = load(str(out / "model.onnx"))  # loads the external data too
    big = [t for t in proto.graph.initializer if len(t.dims) == 2]
    assert big and all(t.data_type == TensorProto.FLOAT16 for t in big)
    dec = rc.OrtDecoder(out / "model.onnx")
    assert dec.dtype == "float16"
    model16 = ox.load_torch_model(resolve_model(str(tiny_model_dir)), "float16")
    for d in rc.compare_decode_logits(dec, model16, prompt_ids, decode_steps=2):
        assert d.ratio() <= rc.TOLERANCE["float16"], d
    assert len(dec.greedy(prompt_ids, 8)) == 8


# --------------------------------------------------------------------------- errors


def test_non_qwen3_folder_is_one_line_error(tiny_model_dir, tmp_path, capsys):
    llama = Path(shutil.copytree(tiny_model_dir, tmp_path / "llama"))
    cfg = json.loads((llama / "config.json").read_text())
    cfg["model_type"] = "llama"
    cfg["architectures"] = ["LlamaForCausalLM"]
    (llama / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    with pytest.raises(ModelSourceError, match="not Qwen3"):
        run_pipeline(str(llama), out, write=lambda _: None)
    assert main(["export-onnx", "--model", str(llama), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not Qwen3" in err and "Traceback" not in err
    assert not out.exists()


def test_existing_output_needs_force(exported, tiny_model_dir, capsys):
    summary, _ = exported
    before = (summary.out_dir / "manifest.json").read_text()
    code = main(["export-onnx", "--model", str(tiny_model_dir), "--out", str(summary.out_dir)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--force" in err and err.strip().count("\n") == 0
    assert (summary.out_dir / "manifest.json").read_text() == before


def test_force_overwrites_only_our_files(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx").write_bytes(b"stale")
    (out / "manifest.json").write_text("{}")
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ox.OutputExistsError):
        run_pipeline(str(tiny_model_dir), out, verify=False, write=lambda _: None)
    assert main(["export-onnx", "--model", str(tiny_model_dir), "--out", str(out), "--force",
                 "--no-verify"]) == 0
    import onnx

    onnx.checker.check_model(str(out / "model.onnx"))
    assert json.loads((out / "manifest.json").read_text())["verify"] is None
    assert (out / "notes.txt").read_text() == "keep me"
    assert not list(tmp_path.glob(".*partial*"))


def test_missing_onnxruntime_says_how_to_install(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import now raises ImportError
    with pytest.raises(ox.OnnxDependencyError, match=r'pip install -e "\.\[onnx\]"') as e:
        run_pipeline(str(tiny_model_dir), tmp_path / "out", write=lambda _: None)
    assert isinstance(e.value, QwenTrtError)
    assert "onnxruntime" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_unsupported_opset_is_refused_before_export(tiny_model_dir, tmp_path):
    with pytest.raises(ox.OnnxExportError, match="--opset 5 is not supported"):
        run_pipeline(str(tiny_model_dir), tmp_path / "out", opset=5, write=lambda _: None)
    assert not (tmp_path / "out").exists()
