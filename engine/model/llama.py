"""A plain Llama checkpoint as torch modules, without importing transformers: the runner's fast start.

The runner computes every step itself and reads only the weights, in the module layout transformers
gives them (``model.model.layers[i].self_attn.q_proj`` …). Importing transformers and its Llama classes
takes about 3 s (they pull in ``torch.distributed.tensor`` and ``torch._dynamo``), more than the model's
load and the first step together, so the demo builds that layout here from the safetensors files, mapped
privately as transformers maps them (the runner's ``PageOut`` drops their fused-away pages the same way),
with the ``tokenizers`` library and the checkpoint's chat template for text. The modules hold weights and
compute what transformers' do (RMSNorm, rotary embedding) so the runner's tokens are the same; they are no
replacement for transformers' model (no ``generate``, no ``forward``). A checkpoint this does not cover
(another architecture, scaled RoPE, biases) gets a reason from ``unsupported`` and the caller loads it
with transformers.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

__all__ = ["unsupported", "load_llama", "ChatTokenizer"]

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def unsupported(config: dict[str, Any]) -> str | None:
    """Why ``config`` (a checkpoint's config.json) is not a plain Llama these modules reproduce, or None."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    checks = [
        (config.get("model_type") == "llama", f"model type {config.get('model_type')!r}"),
        (rope.get("rope_type", rope.get("type", "default")) == "default", "scaled RoPE"),
        (config.get("hidden_act", "silu") == "silu", f"activation {config.get('hidden_act')!r}"),
        (not config.get("attention_bias") and not config.get("mlp_bias"), "projection biases"),
        (config.get("pretraining_tp", 1) == 1, "tensor-parallel pretraining slices"),
    ]
    return next((why for ok, why in checks if not ok), None)


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalised in float32, scaled in the input's dtype."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """transformers' default rotary embedding, the same operations in the same order (same bits)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)),
                             persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


class _Module(nn.Module):
    """A container whose children are given as keywords (the layout's names are transformers')."""

    def __init__(self, **children: Any) -> None:
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


class LlamaModel(nn.Module):
    """What the runner drives: ``model`` (embeddings, layers, norm, rotary embedding), ``lm_head``, ``config``."""

    def __init__(self, config: SimpleNamespace, weights: dict[str, torch.Tensor],
                 generation_config: SimpleNamespace) -> None:
        super().__init__()
        self.config, self.generation_config = config, generation_config
        eps = config.rms_norm_eps

        def layer(i: int) -> nn.Module:
            w = {name.removeprefix(f"model.layers.{i}."): t for name, t in weights.items()
                 if name.startswith(f"model.layers.{i}.")}
            attn = _Module(**{p: _linear(w[f"self_attn.{p}.weight"]) for p in ("q_proj", "k_proj", "v_proj", "o_proj")})
            attn.head_dim, attn.scaling = config.head_dim, config.head_dim ** -0.5
            mlp = _Module(**{p: _linear(w[f"mlp.{p}.weight"]) for p in ("gate_proj", "up_proj", "down_proj")},
                          act_fn=nn.SiLU())
            return _Module(self_attn=attn, mlp=mlp, input_layernorm=RMSNorm(w["input_layernorm.weight"], eps),
                           post_attention_layernorm=RMSNorm(w["post_attention_layernorm.weight"], eps))

        embed = nn.Embedding.from_pretrained(weights["model.embed_tokens.weight"])  # no random init to overwrite
        self.model = _Module(embed_tokens=embed, layers=nn.ModuleList(layer(i) for i in range(config.num_hidden_layers)),
                             norm=RMSNorm(weights["model.norm.weight"], eps),
                             rotary_emb=RotaryEmbedding(config.head_dim, config.rope_theta))
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = _linear(weights["model.embed_tokens.weight"] if tied else weights["lm_head.weight"])


def _mapped(path: Path, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file in ``dtype`` on ``device``: views of a private mapping of the
    file where nothing changes (no copy, nothing read yet); otherwise converted one by one, each tensor's
    pages of the file dropped once converted, so loading an fp32 file as bf16 never holds both whole."""
    with open(path, "rb") as fh:
        size = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(size))
        mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # writable views; the file stays as it is
    base = 8 + size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        stored = _DTYPES.get(info["dtype"])
        if stored is None:
            raise ValueError(f"{path.name}: tensor {name} has dtype {info['dtype']}, not one of {sorted(_DTYPES)}")
        start, end = base + info["data_offsets"][0], base + info["data_offsets"][1]
        t = torch.frombuffer(mapping, dtype=stored, count=(end - start) // stored.itemsize, offset=start).view(info["shape"])
        if stored == dtype and device == "cpu":
            out[name] = t
            continue
        out[name] = t.to(device=device, dtype=dtype)
        lo = start - start % mmap.PAGESIZE  # a page shared with a neighbour is read again from the file if needed
        mapping.madvise(mmap.MADV_DONTNEED, lo, end - lo)
    return out


def load_llama(directory: Path, *, dtype: torch.dtype, device: str = "cpu") -> LlamaModel:
    """The checkpoint in ``directory`` (config.json and model.safetensors, or shards with their index)."""
    raw = json.loads((directory / "config.json").read_text())
    why = unsupported(raw)
    if why is not None:
        raise ValueError(f"{directory} is not a plain Llama checkpoint ({why})")
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(_mapped(directory / name, dtype, device))
    rope = raw.get("rope_parameters") or {}
    config = SimpleNamespace(**{**raw, "head_dim": raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
                                "rope_theta": rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
                                "tie_word_embeddings": raw.get("tie_word_embeddings", False),
                                "name_or_path": str(directory)})
    gen_path = directory / "generation_config.json"
    generation = SimpleNamespace(**(json.loads(gen_path.read_text()) if gen_path.is_file() else {}))
    return LlamaModel(config, weights, generation).eval()


class ChatTokenizer:
    """The checkpoint's fast tokenizer (tokenizer.json) and chat template, as the runner calls a
    transformers tokenizer: ``tok(text)["input_ids"]``, ``apply_chat_template``, ``decode``. The template
    renders in a sandbox with transformers' settings and its text is encoded without added special tokens,
    as transformers does."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        cfg_path = directory / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the one transformers uses by default
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if template is None and (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()
        self._template = template
        # bos_token, eos_token …: a string, or an added token saved with its content
        self._special = {k: v if isinstance(v, str) else v.get("content") for k, v in cfg.items()
                         if k.endswith("_token") and isinstance(v, (str, dict))}

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": self._tok.encode(text).ids}

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False,
                            tokenize: bool = True) -> list[int] | str:
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = json.dumps
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self._template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                      **self._special)
        return self._tok.encode(text, add_special_tokens=False).ids if tokenize else text

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
