"""The serve suite's word-level tokenizer sends the prompt it means (issue 34).

Its special tokens were named ``t0``-``t2``, and the fast tokenizer matches special tokens inside
words: ``"t17 t204 t21"`` became ``[1, 0, 2, 0, 2, 0]``. They are ``<unk>``, ``<s>``, ``</s>`` now.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_support import SPECIALS, VOCAB, prompts, text, write_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = write_tokenizer(str(tmp_path_factory.mktemp("tok")))
    return transformers.AutoTokenizer.from_pretrained(path)


def ids(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def test_words_that_start_like_the_old_special_names_are_their_own_ids(tokenizer):
    assert ids(tokenizer, "t17 t204 t21") == [17, 204, 21]
    assert ids(tokenizer, text([10, 11, 12, 20, 21, 22, 100, 199, 200, 299])) == [10, 11, 12, 20, 21, 22, 100, 199,
                                                                                  200, 299]


def test_every_word_and_the_suites_prompts_round_trip(tokenizer):
    every = list(range(len(SPECIALS), VOCAB))
    assert ids(tokenizer, text(every)) == every
    for prompt in prompts():
        want = [int(word[1:]) for word in prompt.split()]
        assert ids(tokenizer, prompt) == want
        assert tokenizer.decode(want) == prompt


def test_the_specials_are_the_configured_ones(tokenizer):
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert ids(tokenizer, "t3 <zzz>") == [3, 0]  # an unknown word is <unk>, not a special by prefix


def test_text_refuses_the_special_ids():
    with pytest.raises(ValueError, match="prompt tokens"):
        text([5, 1])
