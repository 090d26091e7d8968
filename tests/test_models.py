"""Model sources and the shared-tokenizer check."""
from __future__ import annotations

import pytest
import torch

from compute.models import ModelSpec, byte_tokenizer, check_same_tokenizer, load_model, model_fingerprint
from data_gen.features import token_features


def test_unknown_source_lists_accepted_forms():
    with pytest.raises(ValueError, match="accepted forms.*packaged:.*tiny:SEED.*gguf.*truncated"):
        load_model(ModelSpec("no-such-thing"))


def test_bad_dtype_names_the_flag():
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec("tiny:1", dtype="int3")


def test_truncated_companion_shares_tokenizer_and_is_smaller():
    base, tok = load_model(ModelSpec("tiny:1:32:3"))
    comp, ctok = load_model(ModelSpec("truncated:1:tiny:1:32:3"))
    assert len(comp.get_decoder().layers) == 1 and comp.config.num_hidden_layers == 1
    check_same_tokenizer({"draft": tok, "companion": ctok}, {"draft": base, "companion": comp})
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert comp(ids).logits.shape == base(ids).logits.shape
    with pytest.raises(ValueError, match="only 3 layers"):
        load_model(ModelSpec("truncated:3:tiny:1:32:3"))


def test_tokenizer_mismatch_names_both_models_and_first_token():
    a = byte_tokenizer()
    b = byte_tokenizer()
    b.add_tokens(["<extra>"])
    a.add_tokens(["<other>"])
    with pytest.raises(ValueError,
                       match=r"draft \(x\) and target \(y\) disagree at token id 259 \('<other>' vs '<extra>'"):
        check_same_tokenizer({"draft (x)": a, "target (y)": b})


def test_fingerprint_and_features_shapes(tiny_pair):
    draft, target, tok = tiny_pair
    fp = model_fingerprint(draft, tok)
    assert fp["name"] == "tiny:1" and fp["hidden_size"] == 32 and fp["vocab_size"] == len(tok)
    logits = torch.randn(3, 5, fp["vocab_size"])
    f = token_features(logits, logits.argmax(-1), target_logits=torch.randn_like(logits), top_k=4)
    assert f["draft_topk"].shape == (3, 5, 4) and f["q"].shape == (3, 5)
    assert torch.allclose(f["q"], f["draft_max_prob"])
