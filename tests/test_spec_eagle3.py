"""The EAGLE-3 draft (qwen_trt.fast.spec.eagle3): both published layouts (written by
``qwen-trt tiny-draft``) load to the same module; its step equals an independent reference
built from transformers' Llama pieces; the cache, the chain and the d2t map; one-line errors for
drafts that do not fit the target."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from qwen_trt.cli import main
from qwen_trt.errors import ModelSourceError
from qwen_trt.fast.model.config import FastConfig
from qwen_trt.fast.spec.eagle3 import (Eagle3Config, default_aux_layers, load_eagle3,
                                       read_config)
from qwen_trt.model.tiny_draft import write_tiny_draft



pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def target(tiny_model_dir) -> FastConfig:
    return FastConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))


@pytest.fixture(scope="module")
def embed(tiny_model_dir) -> torch.Tensor:
    return load_file(str(tiny_model_dir / "model.safetensors"))["model.embed_tokens.weight"]


@pytest.fixture(scope="module")
def drafts(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {layout: write_tiny_draft(root / layout, tiny_model_dir, layout, seed=3)
            for layout in ("sglang", "speculators")}


@pytest.fixture(scope="module")
def draft(drafts, target):
    return load_eagle3(drafts["sglang"], target)


def _inputs(draft, target, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(rows, draft.n_aux * target.hidden, generator=g)
    ids = torch.randint(0, target.vocab_size, (rows,), generator=g)
    return aux, ids


def test_both_layouts_load_to_the_same_module(drafts, target, embed):
    a, b = (load_eagle3(drafts[k], target) for k in ("sglang", "speculators"))
    assert a.cfg.layout == "sglang" and b.cfg.layout == "speculators"
    # SGLang names the layer whose output is taken (+1); speculators the one it enters
    assert a.aux_ids == b.aux_ids == (1, 1, 2)
    assert b.cfg.num_speculative_tokens == 3
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    aux, ids = _inputs(a, target, 5)
    pos = torch.arange(5)
    seqs = torch.zeros(5, dtype=torch.long)
    oa = a(ids, aux, pos, seqs, a.new_cache(1, 16), embed)
    ob = b(ids, aux, pos, seqs, b.new_cache(1, 16), embed)
    assert torch.equal(oa.logits, ob.logits) and torch.equal(oa.hidden, ob.hidden)
    assert oa.logits.shape == (5, a.cfg.draft_vocab) and oa.hidden.shape == (5, target.hidden)


def _reference(folder, aux, ids, embed):
    """The EAGLE-3 layer over one whole sequence, from the checkpoint's own tensors and
    transformers' Llama RMSNorm / rotary / MLP (no cache: full causal attention)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm,
                                                          LlamaRotaryEmbedding,
                                                          apply_rotary_pos_emb, repeat_kv)

    raw = json.loads((folder / "config.json").read_text())
    cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures",
                                                                   "eagle_config")})
    w = {k.replace("midlayer.", ""): v for k, v in load_file(str(folder /
                                                                 "model.safetensors")).items()}

    def norm(name, x):
        n = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        n.weight.data.copy_(w[name])
        return n(x)

    t, hd = ids.shape[0], cfg.head_dim
    h = aux @ w["fc.weight"].T
    x = torch.cat([norm("input_layernorm.weight", embed[ids]), norm("hidden_norm.weight", h)], -1)
    q = (x @ w["self_attn.q_proj.weight"].T).view(1, t, -1, hd).transpose(1, 2)
    k = (x @ w["self_attn.k_proj.weight"].T).view(1, t, -1, hd).transpose(1, 2)
    v = (x @ w["self_attn.v_proj.weight"].T).view(1, t, -1, hd).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(t).view(1, -1))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    att = F.scaled_dot_product_attention(q, repeat_kv(k, group), repeat_kv(v, group),
                                         is_causal=True)
    h = h + att.transpose(1, 2).reshape(t, -1) @ w["self_attn.o_proj.weight"].T
    mlp = LlamaMLP(cfg)
    for part in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, part).weight.data.copy_(w[f"mlp.{part}.weight"])
    h = h + mlp(norm("post_attention_layernorm.weight", h))
    return norm("norm.weight", h) @ w["lm_head.weight"].T, h


def test_step_matches_a_reference_built_from_transformers(drafts, draft, target, embed):
    aux, ids = _inputs(draft, target, 9, seed=1)
    ref_logits, ref_hidden = _reference(drafts["sglang"], aux, ids, embed)
    with torch.no_grad():
        out = draft(ids, aux, torch.arange(9), torch.zeros(9, dtype=torch.long),
                    draft.new_cache(1, 32), embed)
    assert torch.allclose(out.logits, ref_logits, atol=1e-5, rtol=1e-4)
    assert torch.allclose(out.hidden, ref_hidden, atol=1e-5, rtol=1e-4)


def test_rows_one_at_a_time_equal_a_prefill_and_sequences_stay_apart(draft, target, embed):
    """Two sequences prefilled together (interleaved rows) equal each alone; feeding a
    sequence row by row through the cache equals its prefill; stale entries past a row's
    position (a rejected draft) are never read."""
    aux, ids = _inputs(draft, target, 12, seed=2)
    seqs = torch.tensor([0, 1] * 6)
    pos = torch.arange(6).repeat_interleave(2)
    both = draft(ids, aux, pos, seqs, draft.new_cache(2, 16), embed)
    cache = draft.new_cache(2, 16)
    cache.k.normal_()                       # garbage where nothing was written yet
    cache.v.normal_()
    for s in (0, 1):
        rows = (seqs == s).nonzero().flatten()
        alone = draft(ids[rows], aux[rows], pos[rows], seqs[rows], draft.new_cache(2, 16),
                      embed)
        assert torch.allclose(alone.logits, both.logits[rows], atol=1e-6)
        for j, r in enumerate(rows.tolist()):
            one = draft(ids[r:r + 1], aux[r:r + 1], pos[r:r + 1], seqs[r:r + 1], cache, embed)
            assert torch.allclose(one.logits[0], both.logits[r], atol=1e-5)
            assert torch.allclose(one.hidden[0], both.hidden[r], atol=1e-5)


def test_propose_chain_drafts_greedily_in_target_ids(draft, target, embed):
    aux, ids = _inputs(draft, target, 7, seed=4)
    seqs = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    last = torch.tensor([3, 6])
    chain = draft.propose_chain(ids, aux, pos, seqs, draft.new_cache(2, 16), embed, k=3,
                                last=last)
    assert chain.shape == (2, 3) and chain.dtype == torch.long
    # by hand: the first step's last rows, then each drafted token at the next position
    cache = draft.new_cache(2, 16)
    out = draft(ids, aux, pos, seqs, cache, embed)
    logits, h, p, s = out.logits[last], out.hidden[last], pos[last], seqs[last]
    want = []
    for _ in range(3):
        tok = draft.draft_to_target(logits.argmax(-1))
        want.append(tok)
        p = p + 1
        o = draft(tok, h, p, s, cache, embed)
        logits, h = o.logits, o.hidden
    assert torch.equal(chain, torch.stack(want, 1))
    assert bool(torch.isin(chain, draft.target_ids).all())
    assert draft.propose_chain(ids[:1], aux[:1], pos[:1], seqs[:1], draft.new_cache(1, 4),
                               embed, k=0).shape == (1, 0)


def test_d2t_maps_draft_ids_to_target_ids(drafts, draft, target):
    state = load_file(str(drafts["sglang"] / "model.safetensors"))
    d2t, t2d = state["d2t"], state["t2d"]
    covered = t2d.nonzero().flatten()
    assert torch.equal(draft.target_ids, torch.arange(d2t.numel()) + d2t)
    assert torch.equal(draft.target_ids, covered)           # sorted subset of the target vocab
    logits = torch.randn(4, draft.cfg.draft_vocab)
    full = draft.target_logits(logits)
    assert full.shape == (4, target.vocab_size)
    assert torch.equal(full[:, covered], logits) and bool((full[:, ~t2d] == float("-inf")).all())
    assert torch.equal(full.argmax(-1), draft.draft_to_target(logits.argmax(-1)))


def test_aux_layer_rules():
    assert default_aux_layers(36) == (2, 18, 33)        # Qwen3-4B
    base = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 515, "draft_vocab_size": 100}
    plain = Eagle3Config.from_hf(base)
    assert plain.aux_layer_ids is None and plain.aux_layers(36) == (2, 18, 33)
    assert plain.head_dim == 16 and plain.rope_theta == 10000.0
    sg = Eagle3Config.from_hf({**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                        [1, 17, 32]}})
    assert sg.aux_layers(36) == (2, 18, 33)             # SGLang's ids are layer outputs
    with pytest.raises(ModelSourceError, match=r"out of range for a target of 2 layers"):
        plain.aux_layers(2)                             # the default needs more layers
    with pytest.raises(ModelSourceError, match="out of range"):
        sg.aux_layers(20)
    with pytest.raises(ModelSourceError, match="not an EAGLE-3 draft"):
        Eagle3Config.from_hf({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64})
    assert Eagle3Config.from_hf({**base, "model_type": "qwen3"}).hidden == 64   # Llama math
    with pytest.raises(ModelSourceError, match="model_type 'mistral'"):
        Eagle3Config.from_hf({**base, "model_type": "mistral"})
    with pytest.raises(ModelSourceError, match="one-layer"):
        Eagle3Config.from_hf({**base, "num_hidden_layers": 2})
    with pytest.raises(ModelSourceError, match="rope_type 'llama3'"):
        Eagle3Config.from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8}})
    with pytest.raises(ModelSourceError, match="hidden_size must be int"):
        Eagle3Config.from_hf({**base, "hidden_size": "64"})


def _edited(src, dst, config=None, drop=(), change=None):
    """A copy of draft folder ``src`` with config keys replaced, weights dropped or replaced."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    for path, value in (config or {}).items():
        node = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(src / "model.safetensors"))
    for k in drop:
        del state[k]
    state.update(change or {})
    save_file(state, str(dst / "model.safetensors"))
    return dst


def test_drafts_that_do_not_fit_the_target_fail_in_one_line(drafts, target, tmp_path):
    sg, sp = drafts["sglang"], drafts["speculators"]
    wide = FastConfig(**{**target.__dict__, "hidden": 128})
    bigger = FastConfig(**{**target.__dict__, "vocab_size": target.vocab_size + 1})
    cases = [
        (sg, wide, "hidden size 64.*target's is 128"),
        (sp, bigger, f"vocabulary of {target.vocab_size} tokens but the target has"),
        (_edited(sg, tmp_path / "miss", drop=["midlayer.self_attn.k_proj.weight"]), target,
         "lacks the weight midlayer.self_attn.k_proj.weight"),
        (_edited(sp, tmp_path / "ids", config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}),
         target, r"aux layer ids \[1, 2, 3\].*out of range"),
        (_edited(sp, tmp_path / "two", config={"eagle_aux_hidden_state_layer_ids": [1, 2]}),
         target, r"fc.weight has shape \(64, 192\), expected \(64, 128\)"),
        (_edited(sg, tmp_path / "d2t", change={"d2t": torch.full((256,), 10_000)}), target,
         "d2t maps draft ids outside"),
        (_edited(sg, tmp_path / "t2d", change={"t2d": torch.zeros(target.vocab_size,
                                                                   dtype=torch.bool)}),
         target, "t2d and d2t disagree"),
        (_edited(sg, tmp_path / "vd", config={"draft_vocab_size": 255}), target,
         r"lm_head.weight has shape \(256, 64\), expected \(255, 64\)"),
        (_edited(sg, tmp_path / "heads", config={"num_attention_heads": 2, "head_dim": 32}),
         target, "q_proj.weight has shape"),
        (_edited(sp, tmp_path / "qk", change={"layers.0.self_attn.q_norm.weight":
                                              torch.ones(16)}), target, "has q/k norms"),
    ]
    for folder, tgt, message in cases:
        with pytest.raises(ModelSourceError, match=message) as e:
            load_eagle3(folder, tgt)
        assert "\n" not in str(e.value)
    with pytest.raises(ModelSourceError, match="no config.json"):
        read_config(tmp_path)


def test_tiny_draft_command(tiny_model_dir, target, tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["tiny-draft", str(out), "--target", str(tiny_model_dir), "--layout",
                 "speculators", "--draft-vocab", "100"]) == 0
    assert "speculators layout" in capsys.readouterr().out
    d = load_eagle3(out, target)
    assert d.cfg.layout == "speculators" and d.cfg.draft_vocab == 100
    assert main(["tiny-draft", str(out), "--target", str(tiny_model_dir)]) == 2   # not empty
    assert "not empty" in capsys.readouterr().err
    assert main(["tiny-draft", str(tmp_path / "e"), "--target", str(tmp_path / "nowhere")]) == 2
    assert "not a Qwen3 checkpoint folder" in capsys.readouterr().err
