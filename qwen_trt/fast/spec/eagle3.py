"""EAGLE-3 draft model for a Qwen3 target: config, loader (both published layouts) and one draft
step over a batch of rows.

The draft is one Llama-style decoder layer that reads, per position, the TARGET's embedding of
the next token and a hidden state: first the target's auxiliary hidden states of three layers
fused by ``fc`` (``[n_aux * hidden] -> [hidden]``), then, for later draft steps, its own
pre-norm output. Per row::

    h = fc(aux) or the draft's previous hidden        residual = h  (norm_before_residual: norm(h))
    x = [input_layernorm(embed(token)), hidden_norm(h)]                        # 2 * hidden
    h = residual + o_proj(attention(rope(q, k), v))  # q/k/v take 2 * hidden, causal over the
    h = h + mlp(post_attention_layernorm(h))          # draft's own KV cache of the sequence
    logits = lm_head(norm(h))  over the draft vocabulary; h is the next step's hidden

Draft id ``i`` is target id ``i + d2t[i]`` (:meth:`Eagle3Draft.draft_to_target`).

**Alignment** (as SGLang and vLLM run it): the target at position ``t`` reads token ``x_t`` and
yields the aux hidden ``a_t``; the draft row at position ``t`` reads ``(x_{t+1}, a_t)`` and
predicts ``x_{t+2}``; the next draft step reads its own hidden at position ``t + 1`` with the
token it drafted.

**Aux layers**: id ``j`` is the hidden state ENTERING target decoder layer ``j`` (the residual
stream after ``j`` layers; the fast path's ``x`` before layer ``j``). vLLM's speculators format
gives these ids as they are (``eagle_aux_hidden_state_layer_ids``); the SGLang layout's
``eagle_config.eagle_aux_hidden_state_layer_ids`` name the layer whose OUTPUT is taken, so SGLang
adds one (and so do we; vLLM reads that field unshifted). Without ids both use ``(2, L // 2,
L - 3)`` for a target of ``L`` layers. The fused input is the aux states concatenated in that
order.

Layouts on disk: **sglang** (the original EAGLE / SpecForge one): ``config.json`` is a
``LlamaConfig`` with ``architectures: ["LlamaForCausalLMEagle3"]`` (``LlamaForCausalLM`` in
EAGLE's own), ``draft_vocab_size``; weights ``midlayer.*``. **speculators** (vLLM):
``architectures: ["Eagle3Speculator"]``, the layer in ``transformer_layer_config``, a
``speculators_config`` block, ``draft_vocab_size``, ``norm_before_residual``,
``target_hidden_size``; weights ``layers.0.*``. Both: ``fc.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t`` (int64 ``[draft_vocab]``), ``t2d`` (bool ``[target_vocab]``); an
``embed_tokens.weight`` is ignored (the target's embedding is used).

The KV cache here is contiguous per sequence (:class:`DraftKVCache`) and the attention is plain
PyTorch: the reference the batched runner's paged version is checked against.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from qwen_trt.errors import ModelSourceError
from qwen_trt.fast.model.config import FastConfig
from qwen_trt.fast.model.reference import rms_norm, rotate_half

LAYOUTS = ("sglang", "speculators")
SGLANG_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# speculators builds its "qwen3" EAGLE-3 layers from Llama's (no q/k norms), like "llama"
LAYER_MODEL_TYPES = ("llama", "qwen3")


def default_aux_layers(target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default aux layer ids (hidden entering those layers) for ``target_layers``
    layers: ``(2, L // 2, L - 3)`` (vLLM's ``get_eagle3_default_aux_hidden_state_layers``,
    SGLang's ``set_eagle3_layers_to_capture``); Qwen3-4B (36 layers): ``(2, 18, 33)``."""
    n = target_layers
    return (2, n // 2, n - 3)


def _get(cfg: dict, key: str, kind: type, where: str, default=None):
    """``cfg[key]`` checked to be ``kind`` (bool is not an int); ``default`` when absent."""
    value = cfg.get(key)
    if value is None:
        value = default
    if value is None:
        raise ModelSourceError(f"{where} lacks {key!r}: not a usable EAGLE-3 draft config.")
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ModelSourceError(f"{where}: {key} must be {kind.__name__}, got {value!r}.")
    return value


@dataclass(frozen=True)
class Eagle3Config:
    """Shape and numerics of an EAGLE-3 draft, from its ``config.json`` (either layout)."""

    layout: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    draft_vocab: int
    target_vocab: int
    target_hidden: int
    aux_layer_ids: tuple[int, ...] | None     # hidden entering these target layers; None: default
    norm_before_residual: bool = False
    num_speculative_tokens: int | None = None  # the checkpoint's suggestion (speculators)

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "config.json") -> "Eagle3Config":
        if not isinstance(cfg, dict):
            raise ModelSourceError(f"{where} is not a JSON object.")
        arch = cfg.get("architectures") or []
        arch = arch if isinstance(arch, list) else [arch]
        if "speculators_config" in cfg or SPECULATORS_ARCHITECTURE in arch:
            kind = cfg.get("speculators_model_type", "eagle3")
            if kind != "eagle3":
                raise ModelSourceError(f"{where} describes a {kind!r} speculator, not EAGLE-3.")
            layer = cfg.get("transformer_layer_config")
            if not isinstance(layer, dict):
                raise ModelSourceError(f"{where} lacks 'transformer_layer_config': not a "
                                       "speculators EAGLE-3 config.")
            ids = cfg.get("eagle_aux_hidden_state_layer_ids")
            shift = 0
            spec = cfg.get("speculators_config") or {}
            methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
            tokens = None
            if isinstance(methods, list) and methods and isinstance(methods[0], dict):
                tokens = methods[0].get("speculative_tokens")
            layout, top = "speculators", cfg
        else:
            if not any(a in SGLANG_ARCHITECTURES for a in arch):
                raise ModelSourceError(
                    f"{where} is not an EAGLE-3 draft (architectures {arch}): expected "
                    f"{SGLANG_ARCHITECTURES[0]} (SGLang / EAGLE layout) or "
                    f"{SPECULATORS_ARCHITECTURE} (vLLM speculators layout).")
            layer, top, layout, tokens = cfg, cfg, "sglang", None
            eagle = cfg.get("eagle_config") or {}
            ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) \
                else None
            shift = 1          # SGLang names the layer whose output is taken
        w = f"{where} ({layout} layout)"
        model_type = layer.get("model_type", "llama")
        if model_type not in LAYER_MODEL_TYPES:
            raise ModelSourceError(f"{w}: draft layers of model_type {model_type!r} are not "
                                   f"supported ({', '.join(LAYER_MODEL_TYPES)}: Llama-style "
                                   "EAGLE-3 layers).")
        if _get(layer, "num_hidden_layers", int, w, 1) != 1:
            raise ModelSourceError(f"{w}: only one-layer EAGLE-3 drafts are supported, this "
                                   f"one has {layer['num_hidden_layers']}.")
        if layer.get("hidden_act", "silu") != "silu":
            raise ModelSourceError(f"{w}: hidden_act {layer['hidden_act']!r} is not supported "
                                   "(silu only).")
        for flag in ("attention_bias", "mlp_bias", "bias"):
            if layer.get(flag):
                raise ModelSourceError(f"{w}: {flag} is not supported.")
        rope = layer.get("rope_parameters") or {}
        scaling = layer.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") \
            or "default"
        if rope_type != "default":
            raise ModelSourceError(f"{w}: rope_type {rope_type!r} is not supported (plain RoPE "
                                   "only).")
        hidden = _get(layer, "hidden_size", int, w)
        heads = _get(layer, "num_attention_heads", int, w)
        kv_heads = _get(layer, "num_key_value_heads", int, w, heads)
        head_dim = layer.get("head_dim") or (hidden // heads if heads else 0)
        if type(head_dim) is not int or hidden <= 0 or heads <= 0 or kv_heads <= 0 \
                or head_dim <= 0 or heads % kv_heads:
            raise ModelSourceError(f"{w}: bad attention shape (hidden {hidden}, heads {heads}, "
                                   f"kv heads {kv_heads}, head_dim {head_dim}).")
        target_vocab = _get(layer, "vocab_size", int, w)
        draft_vocab = _get(top, "draft_vocab_size", int, w, target_vocab)
        target_hidden = _get(top, "target_hidden_size", int, w, hidden)
        if ids is not None:
            if not isinstance(ids, list) or not ids or not all(
                    type(i) is int for i in ids):
                raise ModelSourceError(f"{w}: eagle_aux_hidden_state_layer_ids must be a list "
                                       f"of layer numbers, got {ids!r}.")
            ids = tuple(i + shift for i in ids)
        theta = rope.get("rope_theta", layer.get("rope_theta", 10000.0))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise ModelSourceError(f"{w}: rope_theta must be a positive number, got {theta!r}.")
        return cls(
            layout=layout, hidden=hidden,
            intermediate=_get(layer, "intermediate_size", int, w), heads=heads,
            kv_heads=kv_heads, head_dim=head_dim,
            rms_eps=_get(layer, "rms_norm_eps", float, w, 1e-6),
            rope_theta=float(theta), draft_vocab=draft_vocab, target_vocab=target_vocab,
            target_hidden=target_hidden, aux_layer_ids=ids,
            norm_before_residual=bool(top.get("norm_before_residual", False)),
            num_speculative_tokens=tokens if type(tokens) is int else None)

    def aux_layers(self, target_layers: int, where: str = "the EAGLE-3 draft") -> tuple[int, ...]:
        """The aux layer ids for a target of ``target_layers`` layers (the config's, else
        :func:`default_aux_layers`), each checked to be in ``1..target_layers``."""
        ids = self.aux_layer_ids or default_aux_layers(target_layers)
        bad = [i for i in ids if not 1 <= i <= target_layers]
        if bad:
            how = ("its eagle_aux_hidden_state_layer_ids" if self.aux_layer_ids
                   else f"the default {default_aux_layers(target_layers)}")
            raise ModelSourceError(
                f"{where}: aux layer ids {list(ids)} ({how}) are out of range for a target of "
                f"{target_layers} layers (1..{target_layers}): the draft was made for another "
                "model.")
        return tuple(ids)

    def check_target(self, target: FastConfig, where: str = "the EAGLE-3 draft") -> None:
        """One-line errors where the draft does not fit ``target``."""
        if self.hidden != target.hidden or self.target_hidden != target.hidden:
            raise ModelSourceError(
                f"{where} has hidden size {self.hidden} (target hidden {self.target_hidden}) "
                f"but the target's is {target.hidden}: it was trained for another model.")
        if self.target_vocab != target.vocab_size:
            raise ModelSourceError(
                f"{where} maps to a vocabulary of {self.target_vocab} tokens but the target "
                f"has {target.vocab_size}: it was trained for another model.")
        if self.draft_vocab > self.target_vocab:
            raise ModelSourceError(f"{where}: draft vocabulary {self.draft_vocab} is larger "
                                   f"than the target's {self.target_vocab}.")
        self.aux_layers(target.layers, where)


@dataclass(frozen=True)
class DraftOut:
    """One draft step: ``logits [R, draft_vocab]`` (float32) and the new ``hidden [R, H]``."""

    logits: torch.Tensor
    hidden: torch.Tensor


class DraftKVCache:
    """The draft layer's K/V, contiguous per sequence slot: ``k``, ``v`` ``[slots, kv_heads,
    max_len, head_dim]``. A row of sequence ``s`` at position ``p`` writes slot ``(s, p)`` and
    reads the positions ``<= p`` of ``s``; a rejected draft's entries are simply overwritten
    when those positions come again (nothing past a row's position is read)."""

    def __init__(self, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device) -> None:
        self.k = torch.zeros(slots, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write(self, seqs: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        self.k[seqs, :, pos] = k
        self.v[seqs, :, pos] = v

    def attend(self, q: torch.Tensor, seqs: torch.Tensor, pos: torch.Tensor,
               width: int | None = None) -> torch.Tensor:
        """Causal attention of ``q [R, heads, d]`` over its sequence's cached positions
        ``<= pos``; ``width``: read only the first ``width`` positions (all must be
        ``< width``). Softmax in float32, as HF's eager attention. Returns ``[R, heads * d]``."""
        rows, heads, d = q.shape
        width = width or self.max_len
        k = self.k[seqs, :, :width]                                  # [R, kvh, W, d]
        v = self.v[seqs, :, :width]
        kvh = k.shape[1]
        qg = q.view(rows, kvh, heads // kvh, d)
        s = torch.einsum("rgqd,rgld->rgql", qg, k) * d ** -0.5
        late = torch.arange(width, device=q.device).view(1, 1, 1, -1) > pos.view(-1, 1, 1, 1)
        w = torch.softmax(s.float().masked_fill(late, float("-inf")), dim=-1).to(q.dtype)
        return torch.einsum("rgql,rgld->rgqd", w, v).reshape(rows, heads * d)


class Eagle3Draft(torch.nn.Module):
    """The draft's weights (module docstring) and its step. Build with :func:`load_eagle3`."""

    def __init__(self, cfg: Eagle3Config, aux_ids: tuple[int, ...], dtype: torch.dtype,
                 device) -> None:
        super().__init__()
        self.cfg = cfg
        self.aux_ids = tuple(aux_ids)     # target layers whose entering hidden states fc fuses
        self.n_aux = n_aux = len(self.aux_ids)
        self.dtype = dtype
        h = cfg.hidden

        def buf(name: str, *shape: int, dt: torch.dtype = dtype) -> None:
            self.register_buffer(name, torch.empty(shape, dtype=dt, device=device))

        buf("fc", h, n_aux * cfg.target_hidden)
        buf("wqkv", cfg.q_size + 2 * cfg.kv_size, 2 * h)
        buf("wo", h, cfg.q_size)
        buf("w_gate_up", 2 * cfg.intermediate, h)
        buf("w_down", h, cfg.intermediate)
        for name in ("ln_embed", "ln_hidden", "ln_post", "ln_final"):
            buf(name, h)
        buf("lm_head", cfg.draft_vocab, h)
        buf("d2t", cfg.draft_vocab, dt=torch.long)
        buf("target_ids", cfg.draft_vocab, dt=torch.long)       # arange + d2t
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device,
                                                     dtype=torch.int64).float() / cfg.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.fc.device

    def new_cache(self, slots: int, max_len: int) -> DraftKVCache:
        return DraftKVCache(slots, max_len, self.cfg.kv_heads, self.cfg.head_dim, self.dtype,
                            self.device)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``[R, n_aux * target_hidden]`` aux hidden states -> ``[R, hidden]``."""
        return F.linear(aux.to(self.dtype), self.fc)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.target_ids[draft_ids]

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ``logits [R, draft_vocab]`` spread over the target vocabulary
        (``-inf`` at the tokens the draft cannot propose)."""
        full = logits.new_full((logits.shape[0], self.cfg.target_vocab), float("-inf"))
        return full.index_copy_(1, self.target_ids, logits)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = pos.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)        # [R, 1, d]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return x * cos + rotate_half(x) * sin

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                seqs: torch.Tensor, cache: DraftKVCache, embed: torch.Tensor,
                width: int | None = None) -> DraftOut:
        """One draft step over ``R`` rows, any number per sequence (their K/V are written
        before anyone attends, so rows of one sequence at increasing positions see each other
        causally, as in a prefill). ``ids [R]``: target token ids (embedded with ``embed``, the
        TARGET's ``[vocab, hidden]`` table); ``hidden``: ``[R, n_aux * target_hidden]`` aux
        states (fused here by ``fc``) or ``[R, hidden]`` (the draft's previous output);
        ``positions [R]``, ``seqs [R]``: each row's position and cache slot."""
        cfg, eps = self.cfg, self.cfg.rms_eps
        if hidden.shape[-1] != cfg.hidden:
            hidden = self.fuse(hidden)
        hidden = hidden.to(self.dtype)
        if cfg.norm_before_residual:
            h = rms_norm(hidden, self.ln_hidden, eps)
            residual = h
        else:
            residual = hidden
            h = rms_norm(hidden, self.ln_hidden, eps)
        e = rms_norm(F.embedding(ids, embed).to(self.dtype), self.ln_embed, eps)
        qkv = F.linear(torch.cat([e, h], dim=-1), self.wqkv)
        rows = qkv.shape[0]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = self._rope(q.view(rows, cfg.heads, cfg.head_dim), positions)
        k = self._rope(k.view(rows, cfg.kv_heads, cfg.head_dim), positions)
        cache.write(seqs, positions, k, v.view(rows, cfg.kv_heads, cfg.head_dim))
        o = cache.attend(q, seqs, positions, width)
        x = residual + F.linear(o, self.wo)
        gate, up = F.linear(rms_norm(x, self.ln_post, eps), self.w_gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, self.w_down)
        logits = F.linear(rms_norm(x, self.ln_final, eps), self.lm_head).float()
        return DraftOut(logits, x)

    def propose_chain(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      seqs: torch.Tensor, cache: DraftKVCache, embed: torch.Tensor, k: int,
                      last: torch.Tensor | None = None,
                      width: int | None = None) -> torch.Tensor:
        """``k`` greedy draft tokens (TARGET ids, int64 ``[S, k]``) per sequence: a first
        :meth:`forward` over the given rows, then ``k - 1`` steps of one row per sequence, each
        reading the token it drafted and its own hidden at the next position. ``last``: the row
        of each sequence whose output starts the chain when several rows per sequence are
        given (catching up on accepted tokens); default every row."""
        out = self.forward(ids, hidden, positions, seqs, cache, embed, width)
        logits, h = out.logits, out.hidden
        if last is not None:
            logits, h = logits[last], h[last]
            positions, seqs = positions[last], seqs[last]
        drafts = []
        for step in range(k):
            tok = self.draft_to_target(logits.argmax(-1))
            drafts.append(tok)
            if step + 1 == k:
                break
            positions = positions + 1
            out = self.forward(tok, h, positions, seqs, cache, embed, width)
            logits, h = out.logits, out.hidden
        return torch.stack(drafts, dim=1) if drafts else logits.new_zeros(
            (logits.shape[0], 0), dtype=torch.long)


# -- loading -------------------------------------------------------------------------------

# our buffer <- the checkpoint's names under the layer prefix (fused in this order)
_LAYER_PARTS = {
    "wqkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "wo": ("self_attn.o_proj.weight",),
    "w_gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "w_down": ("mlp.down_proj.weight",),
    "ln_embed": ("input_layernorm.weight",),
    "ln_hidden": ("hidden_norm.weight",),
    "ln_post": ("post_attention_layernorm.weight",),
}
_TOP_PARTS = {"fc": "fc.weight", "ln_final": "norm.weight", "lm_head": "lm_head.weight"}
LAYER_PREFIX = {"sglang": "midlayer.", "speculators": "layers.0."}


def read_config(folder: str | Path) -> Eagle3Config:
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelSourceError(f"'{folder}' has no config.json: not an EAGLE-3 draft "
                               "folder.") from None
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"{path} cannot be read as JSON: {e}") from None
    return Eagle3Config.from_hf(cfg, str(path))


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the draft folder's ``*.safetensors`` (or ``pytorch_model.bin``), on
    the CPU, names as stored minus a leading ``model.``."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    try:
        if files:
            from safetensors.torch import load_file

            for f in files:
                state.update(load_file(str(f)))
        elif (folder / "pytorch_model.bin").is_file():
            state = torch.load(folder / "pytorch_model.bin", map_location="cpu",
                               weights_only=True)
        else:
            raise ModelSourceError(f"'{folder}' has no *.safetensors (or pytorch_model.bin): "
                                   "the EAGLE-3 draft has no weights.")
    except ModelSourceError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file: one line
        raise ModelSourceError(f"cannot read the EAGLE-3 weights in '{folder}': "
                               f"{type(e).__name__}: {str(e)[:160]}") from None
    return {(n[len("model."):] if n.startswith("model.") else n): t for n, t in state.items()}


def load_eagle3(folder: str | Path, target: FastConfig, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Eagle3Draft:
    """The draft in ``folder`` (either layout), checked against ``target``."""
    cfg = read_config(folder)
    where = f"the EAGLE-3 draft '{folder}'"
    return build_draft(cfg, read_weights(folder), target, dtype=dtype, device=device,
                       where=where)


def build_draft(cfg: Eagle3Config, state: dict[str, torch.Tensor], target: FastConfig, *,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                where: str = "the EAGLE-3 draft") -> Eagle3Draft:
    """An :class:`Eagle3Draft` from a config and a state dict in either layout's names."""
    cfg.check_target(target, where)
    ids = cfg.aux_layers(target.layers, where)
    prefixes = [p for p in LAYER_PREFIX.values() if any(n.startswith(p) for n in state)]
    prefix = prefixes[0] if len(prefixes) == 1 else LAYER_PREFIX[cfg.layout]
    biases = sorted(n for n in state if n.endswith(".bias"))
    if biases:
        raise ModelSourceError(f"{where} has bias weights ({biases[0]}, ...): not supported.")
    qk = sorted(n for n in state if n.endswith(("q_norm.weight", "k_norm.weight")))
    if qk:
        raise ModelSourceError(f"{where} has q/k norms ({qk[0]}): only Llama-style EAGLE-3 "
                               "layers are supported.")
    deeper = sorted(n for n in state if n.startswith(("layers.1.", "midlayers.1.")))
    if deeper:
        raise ModelSourceError(f"{where} has more than one layer ({deeper[0]}): only one-layer "
                               "drafts are supported.")

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ModelSourceError(f"{where} lacks the weight {name}: the draft is incomplete.")
        return state[name]

    fc = get("fc.weight")
    if fc.dim() != 2 or fc.shape[1] != len(ids) * cfg.target_hidden:
        raise ModelSourceError(
            f"{where}: fc.weight has shape {tuple(fc.shape)}, expected ({cfg.hidden}, "
            f"{len(ids) * cfg.target_hidden}) for {len(ids)} aux layers {list(ids)} of hidden "
            f"{cfg.target_hidden}.")
    draft = Eagle3Draft(cfg, ids, dtype, device)

    def put(dst: torch.Tensor, names: list[str]) -> None:
        parts = [get(n) for n in names]
        src = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if tuple(src.shape) != tuple(dst.shape):
            raise ModelSourceError(f"{where}: weight {names[0]} has shape {tuple(src.shape)}"
                                   f"{' (fused)' if len(parts) > 1 else ''}, expected "
                                   f"{tuple(dst.shape)}: config.json does not match the weights.")
        dst.copy_(src)

    with torch.no_grad():
        for attr, parts in _LAYER_PARTS.items():
            put(getattr(draft, attr), [prefix + p for p in parts])
        for attr, name in _TOP_PARTS.items():
            put(getattr(draft, attr), [name])
        base = torch.arange(cfg.draft_vocab)
        if "d2t" in state:
            d2t = get("d2t").to(torch.long).flatten()
            if d2t.shape[0] != cfg.draft_vocab:
                raise ModelSourceError(f"{where}: d2t has {d2t.shape[0]} entries, the draft "
                                       f"vocabulary {cfg.draft_vocab}.")
        elif cfg.draft_vocab == cfg.target_vocab:
            d2t = torch.zeros(cfg.draft_vocab, dtype=torch.long)
        else:
            raise ModelSourceError(f"{where} lacks d2t, the map from its {cfg.draft_vocab}-token "
                                   f"vocabulary to the target's {cfg.target_vocab}.")
        tids = base + d2t
        if int(tids.min()) < 0 or int(tids.max()) >= cfg.target_vocab \
                or tids.unique().numel() != tids.numel():
            raise ModelSourceError(f"{where}: d2t maps draft ids outside the target's "
                                   f"{cfg.target_vocab} tokens or onto the same id twice.")
        if "t2d" in state:
            t2d = state["t2d"].to(torch.bool).flatten()
            if t2d.numel() != cfg.target_vocab or int(t2d.sum()) != cfg.draft_vocab \
                    or not bool(t2d[tids].all()):
                raise ModelSourceError(f"{where}: t2d and d2t disagree about which target "
                                       "tokens the draft covers.")
        draft.d2t.copy_(d2t)
        draft.target_ids.copy_(tids)
    return draft
