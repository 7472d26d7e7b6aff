"""The demo model's tokenizer: byte-level BPE trained with the `tokenizers` library, saved as Hugging Face files.

Byte-level means every byte sequence is encodable, so any prompt works and UTF-8 split across tokens is the
normal case the detokenizer must handle.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

END_OF_TEXT = "<|endoftext|>"

# The demo model was trained on source code, not on chats: a conversation is rendered as Python comments
# and the model answers by continuing the file.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "# {{ message['role'] }}: {{ message['content'] | replace('\\n', '\\n# ') }}\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}# assistant:\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path) -> Tokenizer:
    """Trains a byte-level BPE on `texts` and writes tokenizer.json and tokenizer_config.json to `out_dir`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eot = tok.token_to_id(END_OF_TEXT)
    # Documents were separated by END_OF_TEXT in training, so a prompt starts after one.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{END_OF_TEXT} $A", pair=f"{END_OF_TEXT} $A {END_OF_TEXT} $B", special_tokens=[(END_OF_TEXT, eot)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": END_OF_TEXT,
        "eos_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
        "add_bos_token": False,  # the post-processor adds it
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok
