"""Backend options, shared by the app and the CLI: flags and QWEN_TRT_* environment variables."""
from __future__ import annotations

import argparse

import pytest

from qwen_trt.backends import BackendConfig
from qwen_trt.errors import ConfigError, QwenTrtError
from qwen_trt.options import OPTIONS, add_backend_args, app_parser, config_from, config_key


def parse_app_config(argv, environ):
    return config_from(app_parser().parse_args(argv), environ)


def test_nothing_given_means_auto():
    assert parse_app_config([], {}) == BackendConfig()


def test_command_line():
    cfg = parse_app_config(["--model", "m", "--engine=e", "--backend", "torch", "--device", "cpu",
                            "--dtype", "bfloat16", "--max-seq-len", "256"], {})
    assert cfg == BackendConfig(backend="torch", model="m", engine="e", device="cpu",
                                dtype="bfloat16", max_seq_len=256)


def test_environment_and_command_line_wins():
    env = {"QWEN_TRT_MODEL": "env-model", "QWEN_TRT_ENGINE": "env-engine",
           "QWEN_TRT_BACKEND": "trtllm", "QWEN_TRT_DEVICE": "cuda:1", "QWEN_TRT_DTYPE": "float16",
           "QWEN_TRT_MAX_SEQ_LEN": "512"}
    cfg = parse_app_config([], env)
    assert cfg == BackendConfig(backend="trtllm", model="env-model", engine="env-engine",
                                device="cuda:1", dtype="float16", max_seq_len=512)
    cfg = parse_app_config(["--model", "cli-model", "--backend", "torch"], env)
    assert (cfg.model, cfg.backend, cfg.engine) == ("cli-model", "torch", "env-engine")


def test_empty_environment_values_are_ignored():
    assert parse_app_config([], {"QWEN_TRT_MODEL": "", "QWEN_TRT_BACKEND": " "}) == BackendConfig()


@pytest.mark.parametrize("argv, env, words", [
    (["--bogus", "1"], {}, "unrecognized arguments"),
    (["--backend", "onnx"], {}, "Unknown backend 'onnx'"),
    ([], {"QWEN_TRT_BACKEND": "vllm"}, "QWEN_TRT_BACKEND"),
    (["--dtype", "int4"], {}, "Unknown dtype"),
    (["--max-seq-len", "lots"], {}, "whole number"),
    (["--model"], {}, "expected one argument"),
])
def test_bad_options_raise_one_clear_line(argv, env, words):
    with pytest.raises(ConfigError) as e:
        parse_app_config(argv, env)
    assert isinstance(e.value, QwenTrtError)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_config_key_differs_per_config_and_table_lists_every_env_var():
    assert config_key(BackendConfig(model="a")) != config_key(BackendConfig(model="b"))
    envs = [o.env for o in OPTIONS]
    assert envs == ["QWEN_TRT_MODEL", "QWEN_TRT_ENGINE", "QWEN_TRT_BACKEND", "QWEN_TRT_DEVICE",
                    "QWEN_TRT_DTYPE", "QWEN_TRT_MAX_SEQ_LEN", "QWEN_TRT_MAX_BATCH", "QWEN_TRT_SPECULATIVE",
                    "QWEN_TRT_NUM_SPECULATIVE_TOKENS", "QWEN_TRT_FAST", "QWEN_TRT_WATCHDOG_S",
                    "QWEN_TRT_QUANTIZATION", "QWEN_TRT_CACHE_DIR",
                    "QWEN_TRT_BASE_URL",
                    "QWEN_TRT_API_KEY"]


def test_fast_mode_from_flag_or_env_and_bad_value():
    assert parse_app_config([], {}).fast == "auto"
    assert parse_app_config(["--fast", "off"], {}).fast == "off"
    assert parse_app_config([], {"QWEN_TRT_FAST": "on"}).fast == "on"
    with pytest.raises(ConfigError, match="Unknown fast mode 'fastest'"):
        parse_app_config(["--fast", "fastest"], {})


def test_quantization_from_flag_or_env_and_bad_value():
    assert parse_app_config([], {}).quantization == "auto"
    assert parse_app_config(["--quantization", "fp8"], {}).quantization == "fp8"
    assert parse_app_config([], {"QWEN_TRT_QUANTIZATION": "int4"}).quantization == "int4"
    with pytest.raises(ConfigError, match="Unknown quantization 'int3'"):
        parse_app_config(["--quantization", "int3"], {})


def test_cli_parser_gets_the_same_options_and_checks():
    p = argparse.ArgumentParser()
    add_backend_args(p)
    p.add_argument("--other")
    args = p.parse_args(["--backend", "torch", "--max-seq-len", "64", "--other", "x"])
    assert config_from(args, {"QWEN_TRT_DTYPE": "float16"}) == BackendConfig(
        backend="torch", max_seq_len=64, dtype="float16")
    with pytest.raises(ConfigError, match=r"Unknown device 'tpu' \(--device / QWEN_TRT_DEVICE\)"):
        config_from(p.parse_args(["--device", "tpu"]), {})


@pytest.mark.parametrize("field, value, words", [
    ("backend", "onnx", "Unknown backend 'onnx'"), ("dtype", "int4", "Unknown dtype 'int4'"),
    ("fast", "x", "Unknown fast mode 'x'"), ("device", "cuda:x", "Unknown device 'cuda:x'"),
    ("max_seq_len", 1, "whole number of tokens >= 32"),
])
def test_backend_config_checks_each_value_once(field, value, words):
    with pytest.raises(ConfigError, match=words):
        BackendConfig(**{field: value})


def test_max_batch_from_flag_and_environment():
    assert parse_app_config(["--max-batch", "8"], {}).max_batch == 8
    assert parse_app_config([], {"QWEN_TRT_MAX_BATCH": "1"}).max_batch == 1
    assert parse_app_config([], {}).max_batch is None


@pytest.mark.parametrize("bad", ["0", "-3", "1000", "eight", "2.5"])
def test_max_batch_out_of_range_is_one_line(bad):
    with pytest.raises(ConfigError, match="--max-batch / QWEN_TRT_MAX_BATCH"):
        parse_app_config(["--max-batch", bad], {})


def test_max_batch_picks_the_runner(monkeypatch):
    from qwen_trt.serving import scheduler
    from qwen_trt.serving.scheduler import SchedulerConfig
    from qwen_trt.serving.serial import SerialRunner
    from qwen_trt.serving.worker import make_runner

    class Batching:                     # a backend whose weights a batching runner can take
        class info:
            stop_token_ids = (7,)

        attached_runner = None

        def take_model(self):
            return "weights"

        def attach_runner(self, runner):
            self.attached_runner = runner

    monkeypatch.setattr(scheduler, "make_batch_runner",
                        lambda model, config, **kw: ("batched", model, config, kw["stop_ids"]))
    assert make_runner(Batching()) == ("batched", "weights", SchedulerConfig(), (7,))
    assert make_runner(Batching(), max_batch=4) == ("batched", "weights",
                                                    SchedulerConfig(max_batch=4), (7,))
    backend = Batching()
    assert make_runner(backend) is backend.attached_runner      # built once, then attached
    assert isinstance(make_runner(Batching(), max_batch=1), SerialRunner)
    # speculation verifies drafts in the batched runner's steps, at --max-batch 1 too
    from qwen_trt.backends import BackendConfig
    from qwen_trt.serving.speculation import SpecConfig

    cfg = BackendConfig(speculative="ngram", num_speculative_tokens="3")
    assert make_runner(Batching(), max_batch=1, cfg=cfg) == (
        "batched", "weights", SchedulerConfig(max_batch=1, speculative=SpecConfig("ngram", 3)),
        (7,))
