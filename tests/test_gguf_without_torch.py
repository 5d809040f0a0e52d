"""The GGUF file's config and tokenizer, read the way jaxpage runs (torch not importable), equal what transformers
reads with torch installed (the reference)."""
from __future__ import annotations

import json
import subprocess
import sys

from jaxpage.models.loader import default_model_path
from tests.factories import WITHOUT_TORCH

TEXTS = ["The capital of France is", " hello  world\n\n\u00fc\u00f1 \u65e5\u672c\u8a9e <|im_start|>x<|im_end|>", "", "1234567"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]

NO_TORCH = WITHOUT_TORCH + """
import json
from pathlib import Path
from jaxpage.models.gguf_metadata import gguf_config, use_without_torch
from jaxpage.models.loader import _load_tokenizer
path = Path(sys.argv[1])
use_without_torch()
config = gguf_config(str(path)).to_diff_dict()
tokenizer = _load_tokenizer(path.parent, {"gguf_file": path.name})
texts, messages = json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(json.dumps({"config": config, "ids": [tokenizer(t)["input_ids"] for t in texts],
                  "chat": tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                  "eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id,
                  "torch_loaded": sys.modules["torch"] is not None}))
"""


def test_config_and_tokenizer_without_torch_equal_transformers_with_torch(hf_smollm2):
    from transformers import AutoConfig

    _, tokenizer = hf_smollm2
    path = default_model_path()
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, str(path), json.dumps(TEXTS), json.dumps(MESSAGES)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["torch_loaded"] is False

    expected = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_diff_dict()
    for key in ("transformers_version", "_model_name_or_path"):  # the file's display name, not the model
        expected.pop(key, None)
        got["config"].pop(key, None)
    assert got["config"] == expected
    assert got["ids"] == [tokenizer(t)["input_ids"] for t in TEXTS]
    assert got["chat"] == tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert (got["eos"], got["bos"]) == (tokenizer.eos_token_id, tokenizer.bos_token_id)
