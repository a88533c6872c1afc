"""`data.sft.token_ids` (how every job tokenises its rows) gives exactly the ids of the tokenizer's own
call, for tokenizers of other families and in every state a job may leave one in."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from hpcrlhf.data.sft import token_ids
from hpcrlhf.models.tokenizer import build_tokenizer

TEXTS = ["12+34=", " 46", "Say the word red, please: <|eos|>", "", "héllo wörld\n\tTabs  and  spaces", "<bos>x<bos>"]


def wordlevel_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose post-processor wraps each text in [CLS] ... [SEP] (BERT's way):
    another family, where add_special_tokens adds tokens at both ends."""
    words = sorted({w for t in TEXTS for w in t.split()} | {"x"})
    vocab = {w: i for i, w in enumerate(["[UNK]", "[CLS]", "[SEP]", "[PAD]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   pad_token="[PAD]")


@pytest.mark.parametrize("make", [build_tokenizer, wordlevel_tokenizer], ids=["bundled-bpe", "wordlevel-cls-sep"])
@pytest.mark.parametrize("special", [True, False])
def test_ids_equal_the_tokenizers_own_call_in_every_state(make, special):
    tok = make()
    expected = [list(ids) for ids in make()(TEXTS, add_special_tokens=special)["input_ids"]]  # a fresh tokenizer
    assert token_ids(tok, TEXTS, add_special_tokens=special) == expected
    # a call with truncation and padding leaves them set on the Rust backend: the next plain call must not inherit them
    tok(TEXTS, truncation=True, max_length=2, padding="max_length")
    assert tok.backend_tokenizer.truncation is not None
    assert token_ids(tok, TEXTS, add_special_tokens=special) == expected
    tok.split_special_tokens = True  # special tokens in the text as plain text
    split = [list(ids) for ids in tok(TEXTS, add_special_tokens=special)["input_ids"]]
    tok.backend_tokenizer.encode_special_tokens = False  # as a call before the setting changed left it
    assert token_ids(tok, TEXTS, add_special_tokens=special) == split
    assert token_ids(tok, [], add_special_tokens=special) == []


def test_the_bundled_tokenizer_splits_its_special_tokens_when_asked():
    """The check above is not vacuous: the states it walks through change the ids."""
    tok = build_tokenizer()
    plain = token_ids(tok, TEXTS, add_special_tokens=False)
    tok.split_special_tokens = True
    assert token_ids(tok, TEXTS, add_special_tokens=False) != plain
