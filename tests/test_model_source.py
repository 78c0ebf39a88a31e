"""Model folder / hub id problems are one clear line, not a traceback."""
import json
import shutil

import pytest

from qwen_trt.model import source as model_source
from qwen_trt.errors import ModelSourceError
from qwen_trt.model.source import looks_like_path, resolve_model


def test_resolves_the_tiny_folder(tiny_model_dir):
    src = resolve_model(str(tiny_model_dir))
    assert src.path == tiny_model_dir and src.model_type == "qwen3"


def test_missing_folder(tmp_path):
    with pytest.raises(ModelSourceError, match="does not exist.*--model"):
        resolve_model(str(tmp_path / "nope"))


def test_not_qwen3(tiny_model_dir, tmp_path):
    d = tmp_path / "llama"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSourceError, match="'llama' checkpoint.*not Qwen3"):
        resolve_model(str(d))


def test_folder_without_config_or_weights(tiny_model_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    d = tmp_path / "noweights"
    shutil.copytree(tiny_model_dir, d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match="no weights"):
        resolve_model(str(d))


def test_unreachable_hub_says_how_to_use_a_local_folder(monkeypatch):
    class LocalEntryNotFoundError(OSError):
        pass

    def offline(*a, **k):
        raise LocalEntryNotFoundError("Name or service not known")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelSourceError) as e:
        resolve_model("Qwen/Qwen3-4B-Instruct-2507")
    msg = str(e.value)
    assert "Cannot reach the Hugging Face hub" in msg and "--model" in msg
    assert "hf download Qwen/Qwen3-4B-Instruct-2507" in msg and "\n" not in msg


def test_default_comes_from_env(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("QWEN_TRT_MODEL", str(tiny_model_dir))
    assert resolve_model(None).path == tiny_model_dir
    assert model_source.DEFAULT_MODEL_ID == "Qwen/Qwen3-4B-Instruct-2507"


def test_hub_ids_versus_paths():
    assert not looks_like_path("Qwen/Qwen3-4B-Instruct-2507")
    for p in ("./x", "/abs/x", "~/x", "tiny", "a/b/c", "models/"):
        assert looks_like_path(p), p


def test_one_shape_reader_and_head_dim_policy():
    """ModelShape is the one reader: the fast path, ONNX and the build agree on head_dim."""
    from qwen_trt.engine.build import check_model_shapes
    from qwen_trt.errors import ConfigError
    from qwen_trt.fast.model.config import FastConfig
    from qwen_trt.model.shape import ModelShape
    from qwen_trt.onnx.export import DecoderShape

    cfg = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelShape.from_config(cfg).head_dim == 4 and ModelShape.from_config(cfg).kv_heads == 2
    explicit = {**cfg, "head_dim": 16}
    for c, want in ((cfg, 4), (explicit, 16)):
        assert (FastConfig.from_hf(c).head_dim, DecoderShape.from_config(c).head_dim,
                check_model_shapes(c).head_dim) == (want, want, want)
    for bad, words in (({**cfg, "hidden_size": "8"}, "'hidden_size' must be a positive whole"),
                       ({k: v for k, v in cfg.items() if k != "vocab_size"}, "lacks 'vocab_size'"),
                       ({**cfg, "head_dim": 2.5}, "'head_dim' must be")):
        with pytest.raises(ConfigError, match=words) as e:
            ModelShape.from_config(bad, "/m/config.json")
        assert str(e.value).startswith("/m/config.json") and "\n" not in str(e.value)
