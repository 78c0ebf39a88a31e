"""What used to hang, print a traceback or load and answer nonsense is one line at load:
non-regular checkpoint files (a FIFO named model.safetensors), a missing folder
(reported before the engine process starts), config numbers (rms_norm_eps, rope_theta, token ids,
dtype), weights that do not fit the config or hold NaN / inf, chat templates that do not parse or
raise, and unexpected errors in the CLI (traceback only with ``qwen-trt --debug``)."""
from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import signal
from pathlib import Path

import pytest

from qwen_trt import settings as qwen_settings
from qwen_trt.cli import main
from qwen_trt.errors import InvalidMessageError, ModelSourceError, QwenTrtError
from qwen_trt.model.source import load_tokenizer, resolve_model

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 60        # only a hang reaches it


def _tiny_vocab() -> int:
    """The tiny model's vocabulary: its BPE tokens, the ChatML tokens and Qwen3's added ones."""
    from qwen_trt.model.template import QWEN3_EXTRA_TOKENS
    from qwen_trt.model.tiny import TinyShape

    return TinyShape().vocab_size + 3 + len(QWEN3_EXTRA_TOKENS)


V = _tiny_vocab()


def _run_bounded(cmd: list[str], env: dict, timeout: float = BOUND_S):
    """Run ``cmd`` in its own session; a hang (a reader blocked on a FIFO, in this process or
    in an engine process it started, holding the interpreter) fails the test instead of
    hanging the suite: the whole session is killed at ``timeout``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{cmd[2:]} still blocked after {timeout} s")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _resolve_error(d: Path) -> str:
    """resolve_model(d)'s error line, from a separate interpreter (FIFO cases: a blocked open
    would hold this one)."""
    code = ("import sys\nfrom qwen_trt.model.source import resolve_model\n"
            "try:\n    resolve_model(sys.argv[1])\nexcept Exception as e:\n"
            "    print(type(e).__name__, str(e), sep='|')\n")
    r = _run_bounded([sys.executable, "-c", code, str(d)], dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    kind, _, msg = r.stdout.rstrip("\n").partition("|")
    assert kind == "ModelSourceError", r.stdout
    return msg


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _write_config(d: Path, cfg: dict) -> None:
    (d / "config.json").write_text(json.dumps(cfg))


def _edit(**changes):
    def edit(d: Path) -> None:
        _write_config(d, {**_config(d), **changes})
    return edit


def _raw_config(old: str, new: str):
    """JSON that Python's json reads but json.dumps would not write (NaN, Infinity)."""
    def edit(d: Path) -> None:
        text = (d / "config.json").read_text()
        assert old in text
        (d / "config.json").write_text(text.replace(old, new))
    return edit


def _fifo(name: str):
    def edit(d: Path) -> None:
        (d / name).unlink()
        os.mkfifo(d / name)
    return edit


def _rewrite_weights(change):
    """Rewrite model.safetensors with ``change(name, tensor) -> tensor`` applied to each."""
    def edit(d: Path) -> None:
        import torch  # noqa: F401
        from safetensors.torch import load_file, save_file

        tensors = load_file(d / "model.safetensors")
        save_file({k: change(k, v) for k, v in tensors.items()}, d / "model.safetensors",
                  metadata={"format": "pt"})
    return edit


def _nan_everywhere(name, t):
    import torch

    return torch.full_like(t, float("nan"))


def _inf_in_the_middle_of_one(name, t):
    if name == "model.layers.1.mlp.up_proj.weight":       # 8192 elements: the sample's 2nd block
        t = t.clone()
        t.view(-1)[2730:2740] = float("inf")
    return t


def _bf16_with_nan(name, t):
    import torch

    t = t.to(torch.bfloat16)
    if name == "model.norm.weight":
        t = t.clone()
        t[3] = float("nan")
    return t


def _wrong_q_proj(name, t):
    import torch

    return torch.zeros(7, t.shape[1]) if name == "model.layers.0.self_attn.q_proj.weight" else t


def _gen_config_eos(d: Path) -> None:
    g = json.loads((d / "generation_config.json").read_text())
    g["eos_token_id"] = [V - 1, 70000]
    (d / "generation_config.json").write_text(json.dumps(g))


def _deeply_nested(d: Path) -> None:
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)


def _extra_token(d: Path) -> None:
    t = json.loads((d / "tokenizer.json").read_text())
    t["added_tokens"].append({**t["added_tokens"][-1], "id": V, "content": "<|extra|>"})
    (d / "tokenizer.json").write_text(json.dumps(t))


# case -> (edit, file named in the message, text in the message)
CASES = {
    "fifo-weights": (_fifo("model.safetensors"), "model.safetensors",
                     "is a FIFO (named pipe), not a regular file"),
    "fifo-tokenizer": (_fifo("tokenizer.json"), "tokenizer.json", "is a FIFO (named pipe)"),
    "fifo-config": (_fifo("config.json"), "config.json", "is a FIFO (named pipe)"),
    "folder-as-weights": (lambda d: ((d / "model.safetensors").unlink(),
                                     (d / "model.safetensors").mkdir()),
                          "model.safetensors", "is a folder, not a regular file"),
    "broken-link": (lambda d: ((d / "tokenizer.json").unlink(),
                               (d / "tokenizer.json").symlink_to(d / "gone.json")),
                    "tokenizer.json", "is a broken link"),
    "eps-nan": (_raw_config('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN'), "config.json",
                "'rms_norm_eps' is nan; it must be a finite number above 0"),
    "eps-inf": (_raw_config('"rms_norm_eps": 1e-06', '"rms_norm_eps": Infinity'), "config.json",
                "'rms_norm_eps' is inf"),
    "eps-zero": (_edit(rms_norm_eps=0), "config.json", "'rms_norm_eps' is 0;"),
    "eps-negative": (_edit(rms_norm_eps=-1e-6), "config.json", "'rms_norm_eps' is -1e-06;"),
    "rope-nan": (_raw_config('"rope_theta": 5000000.0', '"rope_theta": NaN'), "config.json",
                 "'rope_theta' is nan"),
    "eos-out-of-vocab": (_edit(eos_token_id=99999), "config.json",
                         "'eos_token_id' is 99999, not a token id of the model's vocabulary "
                         f"(0 to {V - 1}"),
    "eos-negative": (_edit(eos_token_id=-1), "config.json", "'eos_token_id' is -1"),
    "eos-in-list": (_gen_config_eos, "generation_config.json",
                    f"'eos_token_id' is [{V - 1}, 70000], not a token id"),
    "dtype-unknown": (_edit(dtype="float13"), "config.json", "'dtype' is 'float13', not a dtype"),
    "nested-config": (_deeply_nested, "config.json", "is not valid JSON: nested too deeply"),
    "vocab-mismatch": (_edit(vocab_size=600), "model.safetensors",
                       f"tensor 'model.embed_tokens.weight' has shape [{V}, 64], but config.json "
                       "implies [600, 64]"),
    "hidden-mismatch": (_edit(hidden_size=96), "model.safetensors",
                        f"has shape [{V}, 64], but config.json implies [{V}, 96]"),
    "tokenizer-beyond-vocab": (_extra_token, "tokenizer.json",
                               f"has {V + 1} tokens, more than the model's vocab_size {V}"),
    "shape-mismatch": (_rewrite_weights(_wrong_q_proj), "model.safetensors",
                       "'model.layers.0.self_attn.q_proj.weight' has shape [7, 64], but "
                       "config.json implies [128, 64]"),
    "all-nan-weights": (_rewrite_weights(_nan_everywhere), "model.safetensors",
                        "holds NaN or infinite values"),
    "some-inf-weights": (_rewrite_weights(_inf_in_the_middle_of_one), "model.safetensors",
                         "'model.layers.1.mlp.up_proj.weight' holds NaN or infinite values "
                         "(10 of 4096 sampled)"),
    "bf16-nan": (_rewrite_weights(_bf16_with_nan), "model.safetensors",
                 "'model.norm.weight' holds NaN or infinite values (1 of 64 sampled)"),
}


@pytest.fixture
def checkpoint(tiny_model_dir, tmp_path):
    def make(case: str) -> tuple[Path, str, str]:
        edit, name, needle = CASES[case]
        d = tmp_path / case
        shutil.copytree(tiny_model_dir, d)
        edit(d)
        return d, str(d / name), needle
    return make


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_checkpoint_is_one_line_naming_file_and_value(checkpoint, case):
    d, file, needle = checkpoint(case)
    if case.startswith("fifo"):
        msg = _resolve_error(d)
    else:
        with pytest.raises(QwenTrtError) as e:
            resolve_model(str(d))
        msg = str(e.value)
    assert file in msg and needle in msg and "\n" not in msg, msg


def test_sound_checkpoints_still_load(tiny_model_dir, tmp_path):
    assert resolve_model(str(tiny_model_dir)).config["vocab_size"] == V
    d = tmp_path / "bf16"                              # the real model's dtype, sampled as such
    shutil.copytree(tiny_model_dir, d)
    _rewrite_weights(lambda name, t: t.to(__import__("torch").bfloat16))(d)
    assert resolve_model(str(d)).path == d


# -- chat templates -----------------------------------------------------------------------------
def _with_template(src: Path, dst: Path, template: str) -> Path:
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(template)
    tc = json.loads((dst / "tokenizer_config.json").read_text())
    tc["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(tc))
    return dst


@pytest.mark.parametrize("template, needle", [
    ("{% if messages %}{{ oops", "TemplateSyntaxError: unexpected end of template"),
    ("{{ raise_exception('no system role here') }}", "TemplateError: no system role here"),
    ("{{ messages[0].content.nope() }}", "UndefinedError"),
])
def test_a_chat_template_that_does_not_work_is_one_line_at_load(tiny_model_dir, tmp_path,
                                                                template, needle):
    d = _with_template(tiny_model_dir, tmp_path / "t", template)
    with pytest.raises(ModelSourceError) as e:
        load_tokenizer(d)
    msg = str(e.value)
    assert msg.startswith(f"{d / 'chat_template.jinja'}: the chat template does not work")
    assert needle in msg and "\n" not in msg


def test_a_template_that_rejects_one_conversation_is_a_message_error(tiny_tokenizer):
    from qwen_trt.serving.session import encode_messages

    strict = tiny_tokenizer.chat_template.replace(
        "{%- for message in messages %}",
        "{%- for message in messages %}{%- if message.role == 'tool' %}"
        "{{ raise_exception('tool messages are not supported') }}{%- endif %}")
    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = strict
    assert encode_messages(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidMessageError) as e:
        encode_messages(tok, [{"role": "tool", "content": "x"}, {"role": "user", "content": "hi"}])
    assert str(e.value) == ("The chat template rejected these messages: tool messages are not "
                            "supported")


# -- the CLI ------------------------------------------------------------------------------------
def _cli(*args: str, env_extra: dict | None = None, timeout: float = BOUND_S):
    env = {k: v for k, v in os.environ.items() if k != "QWEN_TRT_DEBUG"}
    env.update(PYTHONPATH=str(ROOT), QWEN_TRT_WORKER="process", **(env_extra or {}))
    return _run_bounded([sys.executable, "-m", "qwen_trt", *args], env, timeout)


def _error_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("qwen-trt: error:")]


def test_cli_chat_reports_a_fifo_and_a_missing_folder_before_the_engine_starts(checkpoint,
                                                                                 tmp_path):
    d, file, _ = checkpoint("fifo-weights")
    for model, needle in ((d, f"{file} is a FIFO (named pipe)"),
                          (tmp_path / "nowhere", "does not exist")):
        r = _cli("chat", "--model", str(model), "--backend", "torch", "--prompt", "hi")
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and needle in r.stderr
        assert len(_error_lines(r.stderr)) == 1
        assert "[qwen-trt engine]" not in r.stderr       # no engine process was started


def test_cli_template_error_is_one_line_traceback_only_on_debug(
        tiny_model_dir, tmp_path):
    d = _with_template(tiny_model_dir, tmp_path / "t", "{% if messages %}{{ oops")
    r = _cli("chat", "--model", str(d), "--backend", "torch", "--device", "cpu", "--prompt", "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = _error_lines(r.stderr)
    assert "chat_template.jinja: the chat template does not work (TemplateSyntaxError" in line
    r = _cli("--debug", "chat", "--model", str(d), "--backend", "torch", "--device", "cpu",
             "--prompt", "hi")
    assert r.returncode == 2 and "Traceback" in r.stderr and "TemplateSyntaxError" in r.stderr


def test_worker_load_error_of_a_foreign_type_prints_no_traceback(monkeypatch, capfd):
    """An error that is not the project's own (a library's RuntimeError) while loading: the
    engine process prints its traceback only with QWEN_TRT_DEBUG=1."""
    from qwen_trt.backends import BackendConfig
    from qwen_trt.serving.client import WorkerClient
    from qwen_trt.serving.events import ModelLoadError
    from qwen_trt.serving.worker import WorkerSpec

    spec = WorkerSpec(BackendConfig(), loader="serving_fakes:load_crashes")
    for debug in ("", "1"):
        monkeypatch.setenv("QWEN_TRT_DEBUG", debug)
        with pytest.raises(ModelLoadError, match=r"^Unexpected error while loading the model "
                                                  r"\(RuntimeError: CUDA out of memory\)\.$"):
            WorkerClient(spec, echo=io.StringIO())
        err = capfd.readouterr().err
        assert ("Traceback" in err) is bool(debug), err


def test_cli_unexpected_error_is_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    import qwen_trt.commands.chat as chat

    def broken(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(chat, "run", broken)
    monkeypatch.setenv("QWEN_TRT_DEBUG", "")            # off; restored after the test
    assert main(["chat", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err == ("qwen-trt: error: unexpected error (RuntimeError: boom); run with --debug (or "
                   "QWEN_TRT_DEBUG=1) for the traceback.\n")
    assert main(["--debug", "chat", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: boom" in err
    assert qwen_settings.get("QWEN_TRT_DEBUG") is True   # the worker process inherits it
    monkeypatch.setenv("QWEN_TRT_DEBUG", "1")
    assert main(["chat", "--prompt", "hi"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_safetensors_sample_reads_only_a_few_blocks(tmp_path):
    """The NaN sample of a large tensor reads at most 4 x 1024 elements."""
    from qwen_trt.model import checks

    n = 1_000_000
    data = struct.pack(f"<{n}f", *([1.0] * n))
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, len(data)]}})
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + data)
    with open(path, "rb") as f:
        raw = checks._sample(f, 8 + len(header), 8 + len(header) + len(data), 4)
    assert len(raw) == 4 * 1024 * 4
