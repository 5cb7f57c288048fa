"""Tiny checkpoints with text: a byte-level BPE tokenizer trained with ``tokenizers`` on the repository's
own docs (nothing downloaded), a ChatML-style chat template, and a numpy-written Mixtral whose vocabulary
is the tokenizer's (tests/_tiny_models.py's NUMPY_MIXTRAL geometry otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
#: the special tokens of the test tokenizer, in id order after training (0, 1, 2, 3)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|bos|>")
#: a ChatML-style template (the format Qwen's checkpoints use), with the BOS the tokenizer_config names
CHATML = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def docs_text() -> list[str]:
    """The repository's README and docs, one string per file (the training corpus)."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [p.read_text(encoding="utf-8") for p in files]


def train_tokenizer(vocab_size: int = 400):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens trained on :func:`docs_text`;
    its post-processor puts ``<|bos|>`` before a plain prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs_text(), trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A $B",
                                                       special_tokens=[("<|bos|>", bos)])
    return tok


def write_text_files(folder, tok=None, template: str | None = CHATML, generation: bool = True) -> Path:
    """Write tokenizer.json, tokenizer_config.json (+ the chat template) and generation_config.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = tok or train_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>"}
    if template is not None:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    if generation:
        ids = [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")]
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return folder


def write_text_checkpoint(folder, vocab_size: int | None = None, tok=None) -> Path:
    """A numpy Mixtral checkpoint (2 layers, 4 experts, hidden 16) with the test tokenizer's files; the
    model's vocabulary is the tokenizer's unless ``vocab_size`` pads it."""
    from _tiny_models import NUMPY_MIXTRAL, numpy_mixtral_tensors
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = tok or train_tokenizer()
    v = vocab_size or tok.get_vocab_size(with_added_tokens=True)
    shards = numpy_mixtral_tensors(2)
    rng = np.random.default_rng(1)
    h = NUMPY_MIXTRAL["hidden_size"]
    shards[0]["model.embed_tokens.weight"] = (rng.standard_normal((v, h)) * 0.5).astype(np.float32)
    shards[0]["lm_head.weight"] = (rng.standard_normal((v, h)) * 0.5).astype(np.float32)
    config = {**NUMPY_MIXTRAL, "vocab_size": v, "num_hidden_layers": 2}
    (folder / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for k, t in enumerate(shards):
        name = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file(t, str(folder / name), metadata={"format": "pt"})
        weight_map.update({n: name for n in t})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    write_text_files(folder, tok)
    return folder
