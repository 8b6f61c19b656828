"""Model resolution: `builtin:tiny-qwen2` made locally, and the from_pretrained loading every path uses.

The builtin model is a tiny randomly initialised Qwen2 plus a BPE tokenizer trained here with
`tokenizers`, saved to a cache directory keyed by their config; loading it is the real-model path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

# The builtin names live in the shared API module, which admission checks model.path against.
from rljob.api import BUILTIN_MODELS as BUILTIN_MODELS
from rljob.api import BUILTIN_PREFIX as BUILTIN_PREFIX
from rljob.api import TINY_QWEN2 as TINY_QWEN2

# The builtin tiny Qwen2: small enough that 2 ranks x 2 iterations run on 2 CPU cores in
# seconds, large enough to have several layers, grouped-query attention and tied embeddings. Its
# fields live with the memory plan, which sizes it without importing the worker.
from rljob.plan import TINY_QWEN2_CONFIG as TINY_QWEN2_CONFIG
from rljob.plan import TINY_QWEN2_VOCAB_SIZE as TOKENIZER_VOCAB_SIZE

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
_SEED = 1234
# A minimal ChatML-like template, so that prompts of chat messages (spec.data.chatTemplate Auto)
# run on the builtin model the way they do on Qwen's: one "<|role|>" line per message, then the
# assistant's turn. The byte-level tokenizer encodes any text, so no special tokens are added.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def cache_root() -> Path:
    """Where built models live: $RLJOB_CACHE_DIR, else ~/.cache/rljob."""
    return Path(os.environ.get("RLJOB_CACHE_DIR") or Path.home() / ".cache" / "rljob")


def _config_key() -> str:
    blob = json.dumps(
        {
            "model": TINY_QWEN2_CONFIG,
            "vocab": TOKENIZER_VOCAB_SIZE,
            "seed": _SEED,
            "v": 2,
            "chat": CHAT_TEMPLATE,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _training_corpus() -> list[str]:
    # The tokenizer only has to cover what the tasks write: digits, operators, short words.
    from rljob_worker.task import ArithmeticTask

    task = ArithmeticTask(seed=_SEED)
    lines = [p.prompt + p.answer for p in task.sample(2000, salt=0)]
    lines += ["Question: what is the answer? Answer:", "The quick brown fox jumps over the dog."]
    return lines


def build_tokenizer() -> PreTrainedTokenizerBase:
    """Train a byte-level BPE tokenizer on the task's own text and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_training_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_qwen2(directory: Path) -> None:
    """Write a tokenizer and a randomly initialised tiny Qwen2 to `directory` (save_pretrained)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_QWEN2_CONFIG,
    )
    torch.manual_seed(_SEED)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def require_directory(path: Path | str) -> None:
    """ValueError for an absolute model path that is no directory here (its volume not mounted).
    It can never be a hub id, and from_pretrained would fail on it with "Repo id must be in the
    form ..." instead of saying what is missing."""
    if str(path).startswith("/") and not Path(path).is_dir():
        raise ValueError(
            f"spec.model.path {path}: no such directory in the pod (mount the volume that holds "
            "it, see docs/volumes-and-env.md, or copy it into the image)"
        )


def resolve_model_path(path: str) -> Path | str:
    """Turn the spec's model.path into something from_pretrained loads.

    Builtin names are built once into the cache (atomically: ranks that race build private
    copies and the first rename wins); anything else is passed through unchanged (the loaders
    refuse an absolute path that is no directory here: require_directory).
    """
    if not path.startswith(BUILTIN_PREFIX):
        return path
    if path not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {path!r}; the builtin models are {BUILTIN_MODELS}")
    target = cache_root() / "models" / f"tiny-qwen2-{_config_key()}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build_tiny_qwen2(staging)
        if not (staging / "config.json").exists() or not any(staging.glob("*.safetensors")):
            # transformers skips writing weights on ranks other than 0 of an initialised
            # process group; never let such a half-built folder become the cache.
            raise RuntimeError(
                f"building {path} wrote no model files into {staging}: build builtin models "
                "before torch.distributed is initialised (the drivers do)"
            )
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a spec dtype name ('bfloat16', 'float16', 'float32')."""
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained, left padding (prompts are batched for generation)."""
    from transformers import AutoTokenizer

    require_directory(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, path: Path | str) -> list[int]:
    """The ids that end an answer: the tokenizer's EOS, then every id the model's config.json and
    generation_config.json declare as eos_token_id (an int or a list). sglang stops on the
    same union (ModelConfig._get_hf_eos_token_id), so the torch engine and the rollout's
    truncation count must too: an instruct model lists several (Qwen2.5's <|im_end|> and
    <|endoftext|>). A hub id reads the same files as a directory does (model_file)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for name in ("config.json", "generation_config.json"):
        file = model_file(path, name)
        declared = json.loads(file.read_text()).get("eos_token_id") if file is not None else None
        if declared is not None:
            ids += [declared] if isinstance(declared, int) else list(declared)
    return list(dict.fromkeys(int(i) for i in ids))


def model_file(path: Path | str, name: str) -> Path | None:
    """The model's file `name`, found where from_pretrained finds it: in a directory, or for a
    hub id in its snapshot in the Hugging Face cache (downloaded when missing, as sglang's
    config loading does; offline, the cache only). None when the model has no such file."""
    from transformers.utils import cached_file

    found = cached_file(
        str(path),
        name,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )
    return Path(found) if found is not None else None


def load_causal_lm(path: Path | str, dtype: torch.dtype) -> PreTrainedModel:
    """AutoModelForCausalLM.from_pretrained: the one loading path for builtin and real models."""
    from transformers import AutoModelForCausalLM

    require_directory(path)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
