"""`qwen-trt chat` end to end on the tiny model, and its error lines."""
import json
import os
import subprocess
import sys

import pytest

from qwen_trt.cli import main


def _run(*args, stdin=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "qwen_trt", *args], input=stdin,
                          capture_output=True, text=True, timeout=120, env=env)


def test_one_shot_json(tiny_model_dir):
    r = _run("chat", "--model", str(tiny_model_dir), "--prompt", "你好 🚀", "--json",
             "--temperature", "0", "--max-new-tokens", "7", "--backend", "torch")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    assert len(lines) == 1
    out = lines[0]
    assert out["tokens"] == 7 and out["finish_reason"] == "length"
    assert out["dropped_turns"] == 0 and out["ttft_ms"] > 0 and isinstance(out["text"], str)
    assert "Traceback" not in r.stderr


def test_repl_multi_turn_with_clear(tiny_model_dir):
    script = "hello\nsecond\n/clear\nhello\n/exit\n"
    r = _run("chat", "--model", str(tiny_model_dir), "--json", "--temperature", "0",
             "--max-new-tokens", "3", stdin=script)
    assert r.returncode == 0, r.stderr
    replies = [json.loads(x) for x in r.stdout.splitlines() if x.strip().startswith("{")]
    assert len(replies) == 3
    assert replies[1]["prompt_tokens"] > replies[0]["prompt_tokens"]   # history is in the prompt
    assert replies[2]["prompt_tokens"] == replies[0]["prompt_tokens"]   # history cleared
    assert "conversation cleared" in r.stderr


@pytest.mark.parametrize("args, expect", [
    (["--model", "/definitely/not/here"], "does not exist"),
    (["--prompt", "   "], "message is empty"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--max-new-tokens", "5000", "--max-seq-len", "4096"], "leaves no room"),
    (["--device", "tpu"], "Unknown device 'tpu'"),
    (["--max-seq-len", "-5"], "whole number of tokens >= 32"),
    (["--fast", "maybe"], "Unknown fast mode"),
])
def test_bad_input_is_one_clear_line(tiny_model_dir, capsys, args, expect):
    base = ["chat", "--model", str(tiny_model_dir), "--prompt", "hi", "--backend", "torch"]
    code = main(base + args)
    err = capsys.readouterr().err
    assert code == 2
    assert expect in err and "Traceback" not in err


def test_repl_reports_bad_input_and_keeps_going(tiny_model_dir):
    r = _run("chat", "--model", str(tiny_model_dir), "--json", "--max-new-tokens", "2",
             "--max-seq-len", "64", stdin="word " * 200 + "\nok\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "too long" in r.stderr
    assert len([x for x in r.stdout.splitlines() if x.startswith("{")]) == 1


def test_tiny_model_command(tmp_path, capsys):
    assert main(["tiny-model", str(tmp_path / "m"), "--layers", "1", "--hidden", "32",
                 "--heads", "2", "--kv-heads", "1", "--head-dim", "16"]) == 0
    assert (tmp_path / "m" / "config.json").is_file()
    assert "wrote tiny Qwen3 checkpoint" in capsys.readouterr().out


def test_environment_settings_are_checked_like_flags(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("QWEN_TRT_BACKEND", "foo")
    assert main(["chat", "--model", str(tiny_model_dir), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "Unknown backend 'foo'" in err and "Traceback" not in err
    monkeypatch.setenv("QWEN_TRT_BACKEND", "torch")
    monkeypatch.setenv("QWEN_TRT_MAX_SEQ_LEN", "64")      # read from the environment too
    assert main(["chat", "--model", str(tiny_model_dir), "--prompt", "word " * 100,
                 "--max-new-tokens", "8"]) == 2
    assert "prompt limit is 56 tokens" in capsys.readouterr().err


def test_engine_failure_mid_reply_is_one_line(tiny_model_dir, capsys, monkeypatch):
    from qwen_trt.backends.torch_backend import TorchBackend

    def broken(self, prompt_ids, params):
        yield 5
        if params.max_new_tokens <= 2:   # the load-time warm-up passes
            return
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore details")

    monkeypatch.setattr(TorchBackend, "stream", broken)
    code = main(["chat", "--model", str(tiny_model_dir), "--prompt", "hi", "--backend", "torch"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "The backend failed on this request (RuntimeError: CUDA out of memory" in err


def test_tiny_model_refuses_a_folder_that_is_not_empty(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model-00001-of-00002.safetensors").write_bytes(b"precious")
    (ckpt / "config.json").write_text('{"model_type": "qwen3"}')
    small = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16"]
    assert main(["tiny-model", str(ckpt), *small]) == 2
    err = capsys.readouterr().err
    assert "is not empty (2 entries" in err and "--force" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model-00001-of-00002.safetensors"]
    assert (ckpt / "config.json").read_text() == '{"model_type": "qwen3"}'   # nothing touched
    assert main(["tiny-model", str(ckpt), *small, "--force"]) == 0
    assert "wrote tiny Qwen3 checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize("target, expect", [
    ("/proc/nope", "Cannot write the tiny model to /proc/nope"),
    ("FILE", "is a file, not a folder"),
])
def test_tiny_model_unwritable_target_is_one_line(tmp_path, capsys, target, expect):
    if target == "FILE":
        target = str(tmp_path / "f")
        (tmp_path / "f").write_text("x")
    assert main(["tiny-model", target]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_repl_survives_bytes_that_are_not_utf8(tiny_model_dir):
    # A UTF-8 terminal outside Python's UTF-8 mode: stdin decodes strictly (the harder case).
    env = dict(os.environ, PYTHONUNBUFFERED="1", LC_ALL="C.UTF-8", LANG="C.UTF-8", PYTHONUTF8="0")
    r = subprocess.run([sys.executable, "-m", "qwen_trt", "chat", "--model", str(tiny_model_dir),
                        "--json", "--max-new-tokens", "2", "--temperature", "0"],
                       input=b"first\ncaf\xe9 \xff\xfe ok\nthird\n/exit\n", capture_output=True,
                       timeout=120, env=env)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "not valid UTF-8; they were replaced" in err
    assert len([x for x in r.stdout.splitlines() if x.startswith(b"{")]) == 3   # chat kept


def test_prompt_argument_with_bytes_that_are_not_utf8(tiny_model_dir):
    r = subprocess.run([sys.executable.encode(), b"-m", b"qwen_trt", b"chat", b"--model",
                        str(tiny_model_dir).encode(), b"--json", b"--max-new-tokens", b"2",
                        b"--prompt", b"caf\xe9", b"--system", b"be \xff brief"],
                       capture_output=True, timeout=120, env=dict(os.environ, LC_ALL="C.UTF-8"))
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0 and "Traceback" not in err, err
    assert err.count("not valid UTF-8") == 2
    assert json.loads(r.stdout.splitlines()[-1])["prompt_tokens"] > 0


def test_valid_text_replaces_lone_surrogates():
    from qwen_trt.serving.session import valid_text

    assert valid_text("café") == ("café", False)
    assert valid_text("caf\udce9!") == ("caf\ufffd!", True)      # an escaped byte
    assert valid_text("a\ud800b")[0].replace("\ufffd", "") == "ab"  # JSON's "\ud800"


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt here, however this process was started (``cmd &`` from
    a shell that is not interactive starts it with SIGINT ignored); restored afterwards."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_during_load_is_not_lost_when_a_library_swallows_it(tiny_model_dir, capsys,
                                                                   monkeypatch, ctrl_c_raises):
    import signal
    import time

    from qwen_trt.serving import service as chat   # where the (in-process) engine loads

    real = chat.load_backend

    def swallowing_load(cfg):
        try:                                  # a loader that catches and drops the interrupt
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        return real(cfg)

    monkeypatch.setattr(chat, "load_backend", swallowing_load)
    assert main(["chat", "--model", str(tiny_model_dir), "--prompt", "hi", "--json",
                 "--backend", "torch"]) == 130
    assert capsys.readouterr().out == ""      # no reply after the user pressed Ctrl-C
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("args, expect", [
    (["--temperature", "nan"], "temperature must be a finite number, got nan"),
    (["--temperature", "inf"], "temperature must be a finite number"),
    (["--top-p", "nan"], "top_p must be a finite number"),
    (["--seed", str(2**64)], "seed must be a whole number from 0 to 2**64 - 1"),
    (["--seed", "-1"], "seed must be a whole number from 0 to 2**64 - 1"),
    (["--prompt", ""], "The message is empty"),
    (["--prompt", " \n "], "The message is empty"),
    (["--max-new-tokens", str(10**9)], "max_new_tokens must be from 1 to 262144"),
    (["--max-new-tokens", "300", "--max-seq-len", "300"], "leaves no room"),
    (["--max-seq-len", "2"], "whole number of tokens >= 32"),
])
def test_bad_values_are_refused_before_the_model_loads(capsys, monkeypatch, args, expect):
    from qwen_trt.serving import service as chat   # where the (in-process) engine loads

    def must_not_load(cfg):
        raise AssertionError("the model was loaded before the bad value was refused")

    monkeypatch.setattr(chat, "load_backend", must_not_load)
    base = ["chat", "--model", "/nowhere", "--prompt", "hi"]
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err and "loading model" not in err, err
