"""The bundled tokenizer: a small byte-level BPE trained offline from a corpus shipped here.

Nothing is downloaded. `build_tokenizer` trains a BPE on `hpcrlhf/assets/corpus.txt` with the
`tokenizers` library; the result is the same on every run (verified by the tests), so cached
folders and models built on it are reproducible.

Choices that matter for the bundled arithmetic task:

- Digits are split one per token before BPE sees them, so "345" is always "3" "4" "5" and the
  model can learn digit-wise addition (merged digit chunks would make it a lookup table).
- Byte-level: every string encodes, no unknown tokens in practice (`<|unk|>` exists for tools
  that expect one).
- `<|pad|>` is distinct from `<|eos|>`, so masking padding never hides the real end of text.
- No BOS is added by `encode`/`__call__` (prompt and response tokenized separately then
  concatenate cleanly); the chat template starts with `<|bos|>`.

`tiny_tokenizer_dir()` builds it once and caches it as a `save_pretrained` folder.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hpcrlhf.cache import atomic_dir, cache_dir
from hpcrlhf.errors import ModelError

# Bump when the tokenizer built from the same corpus would change (settings, template...), so
# stale cache entries are not reused.
BUILDER_VERSION = "2"

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS)

# Each message is "<|role|>\n{content}<|eos|>\n"; the generation prompt opens an assistant turn.
# Tools (agents): their names and parameters in a first system block ("Tools: multiply(a, b)": the
# tiny model's context is short); an assistant's structured tool calls as Hermes blocks after its
# content; a tool's result as a user turn "<tool_response>...</tool_response>". Without tools or
# tool messages a render is what it always was.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\nTools: ' }}"
    "{% for t in tools %}"
    "{% set f = t['function'] if t['function'] is defined else t %}"
    "{{ f['name'] + '(' + (f['parameters']['properties'] | list | join(', ')) + ')' }}"
    "{% if not loop.last %}{{ '; ' }}{% endif %}"
    "{% endfor %}"
    "{{ eos_token + '\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown chat role ' + message['role'] + "
    "': use system, user, assistant or tool') }}"
    "{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|user|>\n<tool_response>' + message['content'] + '</tool_response>' + eos_token + '\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>{\"name\":\"' + f['name'] + '\",\"arguments\":' "
    "+ (f['arguments'] | tojson(separators=(',', ':'))) + '}</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def corpus_text() -> str:
    """The bundled training corpus (plain English plus many "a+b=c" lines)."""
    return resources.files("hpcrlhf").joinpath("assets/corpus.txt").read_text(encoding="utf-8")


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the bundled corpus and wrap it for transformers."""
    base = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size <= base:
        raise ModelError(
            f"vocab_size={vocab_size} is too small: the byte alphabet and special tokens "
            f"alone take {base}; use at least {base + 1} (default 512)"
        )
    tok = Tokenizer(models.BPE())
    # Digits first, one per pre-token, then the usual GPT-2 byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One "sentence" per line; the trainer's counts (and so its merges) depend only on the
    # text, and ties between equally frequent pairs are broken by the pair itself.
    tok.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="right",
        model_max_length=512,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tokenizer_key(vocab_size: int = 512) -> str:
    """Identifies a tokenizer build: builder version, vocabulary size and corpus hash."""
    digest = hashlib.sha256(corpus_text().encode("utf-8")).hexdigest()[:12]
    return f"v{BUILDER_VERSION}-{vocab_size}-{digest}"


def tiny_tokenizer_dir(vocab_size: int = 512) -> Path:
    """A `save_pretrained` folder with the bundled tokenizer, built once and cached."""
    final = cache_dir("tokenizer") / tokenizer_key(vocab_size)
    if not final.is_dir():
        with atomic_dir(final) as tmp:
            build_tokenizer(vocab_size).save_pretrained(str(tmp))
    return final
